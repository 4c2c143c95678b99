"""A draft model with its own KV cache, and the oracle drafter built on it.

Each drafting round feeds a window of `WINDOW` tokens from the first slot its
cache lacks up to t0 (at slot n, n + 1 = committed tokens), then gamma-1 single
drafted tokens. After a drafting round the cache lacks at most slot n-1, which
holds the previous round's last draft d_gamma when all drafts were accepted:
that token was never fed to the drafter (the all-accepted trap of docs/design.md
section 2); the window rewrites it. With a 1-token prompt (n = 0) the window
starts at slot 0.

A round that drafts nothing (gamma 0, the shape policy's plain round) does not
run the draft: the cache falls behind by the round's token, and the next
drafting round feeds what it missed: its window of `WINDOW` tokens when that
reaches its t0, else a window of ``catch_up``. When the next round would lack
more than ``catch_up`` tokens, the plain round catches up instead: one pass
over ``catch_up`` tokens, without the output head, about every ``catch_up`` - 1
plain rounds. The default, `WINDOW`, catches up 4 tokens every 4th plain round;
16 makes a plain round about 5% cheaper (on a CPU a pass of 16 tokens costs
about 1.6 of 4) but its wide branch in every drafting round made the Qwen pair's
speculative program compile in about 250 s instead of 45 s, for no speedup
one-repeat runs could resolve (experiments/README.md, "Does the 0.5B drafting
for the 1.5B pay in wall-clock time on this CPU?"). The cache's ``lengths`` is the first slot it
lacks, or one past the drafts it fed (the next round's window then starts at
its t0's slot - 1). The logits of t0 are read from the window's final-norm
state at t0 alone.

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
the last round committed (a block of depth + 1 slots ending at t0) in place of
the 2-token window.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specdec_jax.drafters.base import DraftContext, DrafterBase, PrefillContext, Proposal
from specdec_jax.drafters.chain import draw_chain, drafter_sampling, empty_proposal
from specdec_jax.drafters.dynamic_tree import check_dynamic_shape, grow_dynamic_tree
from specdec_jax.kv_cache import KVCache
from specdec_jax.models.llama import LlamaConfig, apply, forward, lm_head
from specdec_jax.sharding import check_model_axis
from specdec_jax.target import FINAL_NORM
from specdec_jax.token_tree import TreeShape

# Tokens a drafting round's window feeds: t0 and up to WINDOW - 1 it missed (module docstring). On a CPU a pass
# of up to 4 tokens costs about what one token's does (docs/design.md section 8).
WINDOW = 4


@dataclasses.dataclass(frozen=True)
class ModelDrafter(DrafterBase):
    """Draft with a (smaller) Llama of the target's tokenizer.

    config: the draft model's architecture. params: its weights (not hashed).
    corrupt_alpha: None for a real draft model (drafts drawn from its processed
      law q); a float for the oracle (greedy proposals kept with probability
      alpha, q a point mass).
    catch_up: the most tokens the cache may lack at a round's t0 (t0 included),
      the width of a catch-up pass (module docstring); at least WINDOW.
    """

    config: LlamaConfig
    params: Any = dataclasses.field(compare=False, repr=False)
    corrupt_alpha: float | None = None
    name: str = "draft-model"
    tree: TreeShape | None = None
    catch_up: int = WINDOW

    def __post_init__(self):
        check_dynamic_shape(self.tree)
        if self.catch_up < WINDOW:
            raise ValueError(f"catch_up must be at least the window ({WINDOW}), got {self.catch_up}")
        if self.tree is not None and self.corrupt_alpha is not None:
            raise ValueError("the oracle drafts chains only")

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

    def propose(self, params, cache, ctx: DraftContext, gamma: int):
        if self.tree is not None:
            return self._dynamic_tree(params, cache, ctx, gamma)
        n = ctx.num_tokens - 1  # slot of t0
        start = jnp.minimum(cache.lengths, jnp.maximum(n - 1, 0))  # the first slot the cache lacks
        cache = cache.with_lengths(start)
        if gamma == 0:
            return empty_proposal(n.shape[0]), self._fall_behind(params, cache, ctx.tokens, n)
        if self.catch_up == WINDOW:  # plain rounds keep the cache within the window: no wide branch to compile
            at_t0, cache = self._feed(params, cache, ctx.tokens, n, WINDOW)
        else:
            at_t0, cache = jax.lax.cond(jnp.all(n + 1 - start <= WINDOW),
                                        lambda c: self._feed(params, c, ctx.tokens, n, WINDOW),
                                        lambda c: self._feed(params, c, ctx.tokens, n, self.catch_up), cache)
        logits = lm_head(self.config, params, at_t0)[:, 0]  # f32[B,Vo]

        def feed(cache, token, index):  # draft index + 1 at slot n + 1 + index
            logits, cache = forward(self.config, params, token[:, None], cache.with_lengths(n + 1 + index))
            return logits[:, 0], cache

        proposal, cache = draw_chain(ctx, gamma, logits, feed, cache, self.config.vocab_size, params.get("vocab_map"),
                                     self.corrupt_alpha)
        return proposal, cache.with_lengths(n + max(gamma, 1))  # t0 and the drafts fed (all but the last)

    def _feed(self, params, cache: KVCache, tokens: jax.Array, n: jax.Array, width: int):
        """Feeds ``width`` committed tokens from the cache's first missing slot (``lengths``) on, t0 (at slot
        ``n``) among them, and whatever follows in ``tokens: i32[B,T]`` to fill the width. Returns t0's
        final-norm state ``f32[B,1,H]`` and the cache holding slots up to t0 (``lengths`` n + 1)."""
        start = cache.lengths
        slots = start[:, None] + jnp.arange(width)[None, :]
        window = jnp.take_along_axis(tokens, jnp.minimum(slots, tokens.shape[1] - 1), axis=1)
        _, normed, cache = apply(self.config, params, window, cache, slots, hidden_layers=(FINAL_NORM,),
                                 compute_logits=False)
        return jnp.take_along_axis(normed[0], (n - start)[:, None, None], axis=1), cache.with_lengths(n + 1)

    def _fall_behind(self, params, cache: KVCache, tokens: jax.Array, n: jax.Array) -> KVCache:
        """A round without drafts: the cache (``lengths``: its first missing slot) is left behind, unless the
        next round (t0 at n + 1) would lack more than ``catch_up`` tokens; then every row catches up on that
        many tokens from its first missing slot (module docstring; XLA drops t0's unused final-norm state)."""
        return jax.lax.cond(jnp.any(n + 2 - cache.lengths > self.catch_up),
                            lambda cache: self._feed(params, cache, tokens, n, self.catch_up)[1],
                            lambda cache: cache, cache)


    def _dynamic_tree(self, params, cache: KVCache, ctx: DraftContext, nodes: int) -> tuple[Proposal, KVCache]:
        """Re-encode what the last round committed, then grow the tree (module docstring)."""
        n = ctx.num_tokens  # t0 at index and slot n - 1
        fed = jnp.maximum(ctx.last_emit, 1)  # slots n - fed .. n - 1 (the first round: t0 alone)
        start = n - fed
        window = jnp.take_along_axis(ctx.tokens, jnp.minimum(start[:, None] + jnp.arange(self.tree.depth + 1)[None, :],
                                                             ctx.tokens.shape[1] - 1), axis=1)
        logits, cache = forward(self.config, params, window, cache.with_lengths(start))
        first = jnp.take_along_axis(logits, (fed - 1)[:, None, None], axis=1)[:, 0]  # f32[B,Vo] after t0

        def expand(tokens, mask, depth, inputs):
            logits, _, _ = apply(self.config, params, tokens, cache.with_lengths(n), n[:, None] - 1 + depth, mask,
                                 defer_writes=True)
            return logits[:, -self.tree.topk:], None

        vocab_map = params.get("vocab_map")
        return grow_dynamic_tree(self.tree, nodes, first, None, expand, vocab_map, ctx.grammar,
                                 drafter_sampling(ctx, vocab_map, self.config.vocab_size)), cache


def oracle_drafter(target_config: LlamaConfig, target_params, alpha: float) -> ModelDrafter:
    """The oracle: the target's own greedy next tokens, each wrong with probability 1 - alpha."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"oracle alpha must be in [0, 1], got {alpha}")
    return ModelDrafter(target_config, target_params, corrupt_alpha=float(alpha), name="oracle")
