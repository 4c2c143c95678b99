"""A draft model with its own KV cache, and the oracle drafter built on it.

Each drafting round feeds a window of `WINDOW` tokens from the first slot its
cache lacks up to t0 (at slot n, n + 1 = committed tokens), then gamma-1 single
drafted tokens. After a drafting round the cache lacks at most slot n-1, which
holds the previous round's last draft d_gamma when all drafts were accepted:
that token was never fed to the drafter (the all-accepted trap of docs/design.md
section 2); the window rewrites it. With a 1-token prompt (n = 0) the window
starts at slot 0. The cache's ``lengths`` is the first slot it lacks, or one
past the drafts it fed (the first slot it lacks is then at most t0's slot - 1).
The logits of t0 are read from the window's final-norm state at t0 alone.
A chain that stops early (``stop_below``, `--draft-confidence`: after its first
draft of low confidence, `chain.draw_chain`) fed t0 and its drafts but the
last, so its cache's length is one past those.

A proposal only reads the cache: the keys and values of the window and of each
fed draft go into a pending `KVBlock` that the next draft step attends to beside
the cache, and `settle` writes it after the engine's per-size switch (a cache
written inside the switch, or inside the chain's loop, is copied by XLA every
round: docs/design.md section 3). The catch-up passes read in a conditional and
write after it, for the same reason.

A round that drafts nothing (gamma 0, the shape policy's plain round) does not
run the draft at all: its cache falls one token behind. A round that drafts
again first catches up (`resume`, run once per round before the proposal, so
compiled once whatever the proposal's size): passes of ``catch_up`` tokens from
each row's first missing slot until every row's window reaches its t0. The cache
may fall behind by any number of tokens (it is bounded by the capacity): a run
of plain rounds costs the target's steps alone, the catching up is paid only
when drafting resumes (never, when the row ends first), and a pass of 16 tokens
costs on a CPU about 1.6 passes of 4 (docs/design.md section 2).

A draft with a reduced output vocabulary (`LlamaConfig.output_vocab_size`, the
`vocab_map` weight) draws among its Vo ids and maps them to target ids; its law
q over the target vocabulary is zero outside them, which verification handles
like any other zero of q.

The oracle drafter is this drafter run with the *target's* weights, greedy,
each proposal replaced by a wrong token with probability 1 - alpha: greedy
acceptance is then i.i.d. Bernoulli(alpha) per position and tokens per round
follow the closed form `(1 - alpha^(gamma+1)) / (1 - alpha)`.

With a `TreeShape` the draft grows EAGLE-2's dynamic tree from its own logits
(`drafters.dynamic_tree`): the tree's nodes are scored under the ancestor mask
without writing the draft's cache, so each round first re-encodes the tokens
the last round committed (a block of depth + 1 slots from the first slot the
cache lacks, ending at or past t0) in place of the chain's window.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specdec_jax.drafters.base import DraftContext, DrafterBase, PrefillContext, Proposal
from specdec_jax.drafters.chain import check_stop_below, draw_chain, drafter_sampling, empty_proposal
from specdec_jax.drafters.dynamic_tree import check_dynamic_shape, grow_dynamic_tree
from specdec_jax.kv_cache import CacheWrite, KVBlock, KVCache, ordered_read
from specdec_jax.models.llama import LlamaConfig, apply, forward, lm_head
from specdec_jax.sharding import check_model_axis
from specdec_jax.target import FINAL_NORM
from specdec_jax.token_tree import TreeShape

# Tokens a drafting round's window feeds: t0 and up to WINDOW - 1 it missed (module docstring). On a CPU a pass
# of up to 4 tokens costs about what one token's does (docs/design.md section 8).
WINDOW = 4
CATCH_UP = 16  # tokens per catch-up pass (module docstring)
# The acceptance a draft model of the target's family typically reaches (the Qwen2.5-Coder pair's 0.5B gives the
# 1.5B's greedy token on 84% of Spec-Bench positions), the shape policy's prior for its chains: from CHAIN_PRIOR's
# 0.5 a row spends its first rounds on short chains (docs/shape_policy.md, "A draft model's prior").
CHAIN_ACCEPTANCE = 0.75


@dataclasses.dataclass(frozen=True)
class ModelDrafter(DrafterBase):
    """Draft with a (smaller) Llama of the target's tokenizer.

    config: the draft model's architecture. params: its weights (not hashed).
    oracle: False for a real draft model (drafts drawn from its processed law
      q); True for the oracle (greedy proposals kept with probability
      ``params["oracle_alpha"]``, an f32[] weight, so that every alpha runs one
      compiled program; q a point mass).
    catch_up: the width of a catch-up pass (module docstring).
    stop_below: a chain ends after its first draft of confidence below this (`chain.draw_chain`,
      `--draft-confidence`); the draft passes after it are skipped. 0: every chain is gamma long.
    """

    config: LlamaConfig
    params: Any = dataclasses.field(compare=False, repr=False)
    oracle: bool = False
    name: str = "draft-model"
    tree: TreeShape | None = None
    catch_up: int = CATCH_UP
    stop_below: float = 0.0

    def __post_init__(self):
        check_dynamic_shape(self.tree)
        if self.catch_up < 1:
            raise ValueError(f"catch_up must be at least 1, got {self.catch_up}")
        if self.tree is not None and self.oracle:
            raise ValueError("the oracle drafts chains only")
        check_stop_below(self.stop_below, self.tree)
        if self.stop_below and self.oracle:
            raise ValueError("a draft confidence stops chains drawn from a drafter's law: the oracle's are not")

    @property
    def acceptance_prior(self) -> float | None:
        """`CHAIN_ACCEPTANCE` for a real draft model's chains; None (the policy's default) for a tree or the
        oracle, whose acceptance is its parameter."""
        return None if self.oracle or self.tree is not None else CHAIN_ACCEPTANCE

    def check(self, target, mesh) -> None:
        if self.config.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.config.vocab_size}) differs from the "
                             f"target's ({target.vocab_size})")
        if mesh is not None:
            check_model_axis(mesh, self.config, "the draft model")

    def init(self, params, prefill: PrefillContext):
        cache = self.config.init_cache(prefill.prompts.shape[0], prefill.capacity)
        _, cache = forward(self.config, params, prefill.prompts, cache, compute_logits=False)
        return cache.with_lengths(prefill.prompt_lens)

    @property
    def window(self) -> int:
        """Tokens a drafting round feeds up to its t0: `WINDOW`, or a tree's re-encoded block (depth + 1)."""
        return WINDOW if self.tree is None else self.tree.depth + 1

    def resume(self, params, cache: KVCache, ctx: DraftContext, drafting: jax.Array | None) -> KVCache:
        """Before a round that drafts (``drafting`` bool[]): passes of ``catch_up`` tokens from each row's first
        missing slot while the window of some row that may still draft (room > 0; a finished row is never caught
        up) would not reach its t0 (module docstring). Each pass writes every row's next ``catch_up`` committed
        tokens (a row already in reach rewrites its own, harmlessly)."""
        if drafting is None:  # a fixed gamma: every round drafts, the cache never falls behind
            return cache
        n = ctx.num_tokens - 1  # slot of t0

        def behind(cache):
            return drafting & jnp.any((ctx.room > 0) & (n + 1 - _first_missing(cache, n) > self.window))

        def catch_up(cache):
            start = _first_missing(cache, n)
            base = cache.with_lengths(start)
            block = ordered_read(lambda c: self._read(params, c, ctx.tokens, self.catch_up)[1], base)
            return base.write_block(block).with_lengths(jnp.minimum(start + self.catch_up, n + 1))

        return jax.lax.while_loop(behind, catch_up, cache)

    def propose(self, params, cache, ctx: DraftContext, gamma: int):
        """``(Proposal, CacheWrite)``: the cache is only read (in a conditional, `kv_cache.ordered_read`); what
        the round fed comes back as a block that `settle` writes (module docstring)."""
        n = ctx.num_tokens - 1  # slot of t0
        start = _first_missing(cache, n)
        if gamma == 0:  # the cache falls behind (module docstring), its drafts past the first missing slot dropped
            nowhere = jnp.full_like(start, cache.capacity)  # past the last slot: the block is dropped
            nothing = CacheWrite(self.config.empty_block(n.shape[0], 1), nowhere, start)
            return empty_proposal(n.shape[0], tree=self.tree is not None), nothing
        draft = self._grow if self.tree is not None else self._chain
        proposal, block = ordered_read(lambda c: draft(params, c, ctx, gamma), cache.with_lengths(start))
        fed = n + 1 if self.tree is not None else n + proposal.num_draft  # t0 and the drafts fed (all but the last)
        return proposal, CacheWrite(block, start, fed)

    def settle(self, params, cache: KVCache, write: CacheWrite) -> KVCache:
        """The round's fed keys/values written at the first missing slot on, and the cache's new length."""
        return write.into(cache)

    def _chain(self, params, cache: KVCache, ctx: DraftContext, gamma: int) -> tuple[Proposal, KVBlock]:
        """gamma drafts from the window (``cache.lengths`` = its first slot) and gamma - 1 drafts fed one at a
        time; the block holds the slots from the window's first on (column c = slot lengths + c)."""
        n, start = ctx.num_tokens - 1, cache.lengths
        normed, window = self._read(params, cache, ctx.tokens, WINDOW)
        width = WINDOW + gamma - 1  # the window's columns, then the drafts fed after t0 (n - start < WINDOW)
        block = self.config.empty_block(n.shape[0], width).insert(window, jnp.zeros_like(start))
        at_t0 = jnp.take_along_axis(normed, (n - start)[:, None, None], axis=1)  # f32[B,1,H]
        logits = lm_head(self.config, params, at_t0)[:, 0]  # f32[B,Vo]

        def feed(block, token, index):  # draft index + 1 at slot n + 1 + index, column n + 1 + index - start
            column = n + 1 + index - start
            seen = jnp.arange(width)[None, None, :] < column[:, None, None]  # its chain, not the window's junk
            logits, _, new = apply(self.config, params, token[:, None], cache, (n + 1 + index)[:, None],
                                   defer_writes=True, pending=(block, seen))
            return logits[:, 0], block.insert(new, column)

        return draw_chain(ctx, gamma, logits, feed, block, self.config.vocab_size, params.get("vocab_map"),
                          params["oracle_alpha"] if self.oracle else None, self.stop_below)

    def _grow(self, params, cache: KVCache, ctx: DraftContext, nodes: int) -> tuple[Proposal, KVBlock]:
        """Re-encode what the cache lacks up to t0 (from ``cache.lengths``), then grow the tree over it
        (module docstring); the block holds the re-encoded slots."""
        n, start = ctx.num_tokens - 1, cache.lengths
        slots = start[:, None] + jnp.arange(self.window)[None, :]
        window = jnp.take_along_axis(ctx.tokens, jnp.minimum(slots, ctx.tokens.shape[1] - 1), axis=1)
        logits, _, block = apply(self.config, params, window, cache, slots, defer_writes=True)
        first = jnp.take_along_axis(logits, (n - start)[:, None, None], axis=1)[:, 0]  # f32[B,Vo] after t0
        up_to_t0 = jnp.arange(self.window)[None, None, :] <= (n - start)[:, None, None]  # bool[B,1,W]

        def expand(tokens, mask, depth, inputs):
            seen = jnp.broadcast_to(up_to_t0, (tokens.shape[0], tokens.shape[1], self.window))
            logits, _, _ = apply(self.config, params, tokens, cache, n[:, None] + depth, mask, defer_writes=True,
                                 pending=(block, seen))
            return logits[:, -self.tree.topk:], None

        vocab_map = params.get("vocab_map")
        return grow_dynamic_tree(self.tree, nodes, first, None, expand, vocab_map, ctx.grammar,
                                 drafter_sampling(ctx, vocab_map, self.config.vocab_size)), block

    def _read(self, params, cache: KVCache, tokens: jax.Array, width: int) -> tuple[jax.Array, KVBlock]:
        """Reads ``width`` tokens of ``tokens: i32[B,T]`` from the slot ``cache.lengths`` on, at their slots (past
        the committed ones, junk that a later round overwrites), without writing the cache. Returns their
        final-norm states f32[B,width,H] and their keys/values."""
        slots = cache.lengths[:, None] + jnp.arange(width)[None, :]
        window = jnp.take_along_axis(tokens, jnp.minimum(slots, tokens.shape[1] - 1), axis=1)
        _, normed, block = apply(self.config, params, window, cache, slots, hidden_layers=(FINAL_NORM,),
                                 compute_logits=False, defer_writes=True)
        return normed[0], block


def _first_missing(cache: KVCache, n: jax.Array) -> jax.Array:
    """i32[B]: the first slot the cache lacks, given t0 at slot ``n`` (module docstring): ``lengths``, at most
    n - 1 (0 for a 1-token sequence)."""
    return jnp.minimum(cache.lengths, jnp.maximum(n - 1, 0))


def oracle_drafter(target_config: LlamaConfig, target_params, alpha: float) -> ModelDrafter:
    """The oracle: the target's own greedy next tokens, each wrong with probability 1 - alpha."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"oracle alpha must be in [0, 1], got {alpha}")
    return ModelDrafter(target_config, {**target_params, "oracle_alpha": jnp.float32(alpha)}, oracle=True,
                        name="oracle")
