"""EAGLE-style drafting from the target's own features (docs/design.md section 9).

The head is one Llama decoder layer with its own KV cache. Its input at
sequence position j is

    fc(concat(embed(token_{j+1}), g_j)) + fc_bias

where g_j is the target's feature of token j (`feature_layers`: the final-norm
state, EAGLE-1; or several layers concatenated and projected by `feature_proj`,
EAGLE-3) or, while drafting, the head's own output at j - 1 fed back. Its
output h_j predicts the feature of token j + 1; the logits of token j + 2 are
the LM head applied to h_j: the target's (`TargetModel.logits_of`) or a
reduced draft vocabulary (`lm_head [H,Vo]`, `vocab_map i32[Vo]`; q is zero
outside it). The target's embedding is shared, never copied.

Head cache slot j holds the keys/values of input j. A round with `n` committed
tokens (t0 at index n - 1) and `e` tokens emitted by the last round:

1. one block pass of width G + 1 (the engine's widest verify pass) re-encodes slots n-1-e .. n-2 from the
   target's real features of the tokens the last verify pass committed
   (`DraftContext.features`), overwriting what the last round's drafting
   guessed there; its output at slot n - 2 gives the logits of draft 1;
2. gamma - 1 single steps feed draft i with the head's previous output at slot
   n - 2 + i and give the logits of draft i + 1.

Both only read the head's cache: each step attends to the cache below the block
and to the keys/values of the block and the drafts fed before it, kept in a
pending `KVBlock`; `settle` writes that block once, after the engine's per-size
switch (a cache written inside it is copied every round: docs/design.md
section 3).

A round with gamma 0 (the engine's shape policy does not speculate) does not
run the head at all: its cache falls behind, as the draft model's does
(`drafters.model`). The head keeps the projected features of the latest
``max_lag`` committed tokens in a ring (row j % max_lag holds token j's,
written each round in `resume` from the last verify pass), and a round that
drafts again first catches up in `resume`: passes of ``catch_up`` slots from
the first slot the head lacks (the cache's ``lengths``) up to the round's
block, from the ring's features. The ring bounds the lag: a row that would
fall more than ``max_lag`` tokens behind before its next round catches up in
this one, drafting or not (so ``max_lag`` must be at least twice G + 1; G + 1 at a fixed gamma). In
the first round (e = 0) the block re-encodes slot n - 2 from the prompt's
feature, which `init` leaves in the ring. A row whose sequence is a single
token has no feature yet and proposes nothing.

With a `TreeShape` (depth D, top-k K, N nodes) step 2 grows EAGLE-2's dynamic
tree instead (`drafters.dynamic_tree`): the frontier nodes are fed, with their
parents' output features, under the tree's ancestor mask and without writing
the head's cache. The next round's block re-encodes the accepted path from the
target's features, as for a chain.

Weights (H the target's hidden size, k = len(feature_layers), layer weights of
one layer stacked as in `models.llama`)::

    fc [2H, H], fc_bias [H], feature_proj [kH, H] (k > 1 only),
    attn_norm .. w_down [1, ...], lm_head [H, Vo] + vocab_map [Vo] (reduced vocabulary only)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.drafters.base import DraftContext, DrafterBase, PrefillContext, Proposal, check_head
from specdec_jax.drafters.chain import check_stop_below, draw_chain, drafter_sampling, empty_proposal
from specdec_jax.drafters.dynamic_tree import check_dynamic_shape, grow_dynamic_tree
from specdec_jax.kv_cache import CacheWrite, KVBlock, KVCache, ordered_read
from specdec_jax.models.llama import LlamaConfig, init_params, param_shapes, run_layers
from specdec_jax.sharding import check_model_axis
from specdec_jax.target import FINAL_NORM, TargetModel
from specdec_jax.token_tree import TreeShape


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """Static description of an EAGLE head for a target of width `hidden_size` and `vocab_size`."""

    hidden_size: int  # H, the target's
    vocab_size: int  # V, the target's
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    feature_layers: tuple[int, ...] = (FINAL_NORM,)  # target hidden states read (specdec_jax.target)
    output_vocab_size: int | None = None  # None: the target's LM head; else a reduced vocabulary (vocab_map)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    def __post_init__(self):
        object.__setattr__(self, "feature_layers", tuple(int(x) for x in self.feature_layers))
        if not self.feature_layers or len(set(self.feature_layers)) != len(self.feature_layers):
            raise ValueError(f"feature_layers must be distinct layer indices, got {self.feature_layers}")
        if self.output_vocab_size is not None and not 0 < self.output_vocab_size <= self.vocab_size:
            raise ValueError(f"output_vocab_size must be in [1, {self.vocab_size}], got {self.output_vocab_size}")
        self.layer  # noqa: B018 (validates the widths)

    @property
    def layer(self) -> LlamaConfig:
        """The decoder layer as a one-layer LlamaConfig (its vocabulary fields are unused)."""
        return LlamaConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rope_theta=self.rope_theta,
                           rms_norm_eps=self.rms_norm_eps)


def eagle_shapes(cfg: EagleConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every weight (module docstring)."""
    h = cfg.hidden_size
    shapes = {name: shape for name, shape in param_shapes(cfg.layer).items() if name not in
              ("embed", "final_norm", "lm_head")}
    shapes.update(fc=(2 * h, h), fc_bias=(h,))
    if len(cfg.feature_layers) > 1:
        shapes["feature_proj"] = (len(cfg.feature_layers) * h, h)
    if cfg.output_vocab_size is not None:
        shapes.update(lm_head=(h, cfg.output_vocab_size), vocab_map=(cfg.output_vocab_size,))
    return shapes


def init_eagle(cfg: EagleConfig, key: jax.Array, head_rows: np.ndarray | None = None,
               vocab_map: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Random weights (the decoder layer as `models.llama.init_params`; fc and feature_proj
    ~ N(0, 1/fan_in)); a reduced head copies `head_rows` (the target's LM head [H,V]) at `vocab_map`."""
    layer = init_params(dataclasses.replace(cfg.layer, tie_embeddings=True), key)
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)) + 1)
    arrays = {}
    for name, shape in eagle_shapes(cfg).items():
        if name in layer:
            arrays[name] = layer[name]
        elif name == "fc_bias":
            arrays[name] = np.zeros(shape, np.float32)
        elif name in ("fc", "feature_proj"):
            arrays[name] = (rng.standard_normal(shape) / math.sqrt(shape[0])).astype(np.float32)
    if cfg.output_vocab_size is not None:
        if head_rows is None or vocab_map is None:
            raise ValueError("a reduced output vocabulary needs the target's head rows and the vocab_map")
        arrays["vocab_map"] = np.asarray(vocab_map, np.int32)
        arrays["lm_head"] = np.ascontiguousarray(np.asarray(head_rows, np.float32)[:, arrays["vocab_map"]])
    return arrays


def _block_start(n: jax.Array, emitted: jax.Array) -> jax.Array:
    """i32[B]: the first slot a round's block re-encodes (``n`` committed, ``emitted`` by the last round)."""
    return jnp.maximum(n - 1 - jnp.maximum(emitted, 1), 0)


def project(cfg: EagleConfig, params, features: jax.Array) -> jax.Array:
    """f32[..., H]: target features f32[..., k, H] in the head's input space."""
    if len(cfg.feature_layers) == 1:
        return features[..., 0, :]
    return features.reshape(*features.shape[:-2], -1) @ params["feature_proj"]


def head_pass(cfg: EagleConfig, params, target: TargetModel, target_params, tokens: jax.Array,
              inputs: jax.Array, cache: KVCache, positions: jax.Array, block_mask: jax.Array | None = None,
              defer_writes: bool = False, visible: jax.Array | None = None,
              pending: tuple[KVBlock, jax.Array] | None = None) -> tuple[jax.Array, KVCache | KVBlock]:
    """``(h f32[B,S,H], cache)``: the head over ``tokens i32[B,S]`` (token j + 1 of each input j) and
    ``inputs f32[B,S,H]`` (projected features or fed-back outputs) at slots ``cache.lengths + s``
    (``block_mask``, ``defer_writes``, ``visible`` and ``pending`` as in `models.llama.run_layers`;
    deferred: the cache is only read, and the pass's keys/values come back as a `KVBlock` in its place)."""
    x = jnp.concatenate([target.embed(target_params, tokens).astype(jnp.float32), inputs], axis=-1)
    x = x @ params["fc"] + params["fc_bias"]
    h, _, written = run_layers(cfg.layer, params, x, cache, positions, block_mask, defer_writes=defer_writes,
                               visible=visible, pending=pending)
    return h, written


def head_logits(cfg: EagleConfig, params, target: TargetModel, target_params, h: jax.Array) -> jax.Array:
    """f32[..., Vo] logits of the token after the one whose feature ``h f32[..., H]`` predicts."""
    if cfg.output_vocab_size is None:
        return target.logits_of(target_params, h)
    return (h @ params["lm_head"]).astype(jnp.float32)


MAX_LAG = 64  # committed tokens whose features the head keeps for catching up (module docstring)
CATCH_UP = 16  # slots per catch-up pass


@flax.struct.dataclass
class EagleState:
    cache: KVCache  # the head's cache, one layer; lengths: the first slot it lacks
    features: jax.Array  # f32[B,R,H] projected target features of the latest R committed tokens, token j at j % R


class HeadFunctions(NamedTuple):
    """The pieces of a head that EAGLE's rounds (`EagleDrafter`) call, each taking the head's config
    and weights first: ``project(cfg, params, features f32[..., k, Ht]) -> f32[..., H]``; ``head_pass(cfg,
    params, target, target_params, tokens, inputs, cache, positions, block_mask, defer_writes, visible,
    pending) -> (h, cache or, deferred, the pass's KVBlock)`` (`head_pass`'s arguments); ``logits(cfg, params,
    target, target_params, h) -> (logits f32[..., Vo], fed f32[..., H])``: the next token's logits and what the
    next draft step is fed."""

    project: Callable
    head_pass: Callable
    logits: Callable


@dataclasses.dataclass(frozen=True)
class EagleDrafter(DrafterBase):
    """Drafts with an EAGLE head (module docstring). params: the head's weights (not hashed). An EAGLE-3
    head (`drafters.eagle3`) runs the same rounds with its own `HeadFunctions` and target checks."""

    config: EagleConfig
    params: Any = dataclasses.field(compare=False, repr=False)
    name: str = "eagle"
    tree: TreeShape | None = None
    head: ClassVar[HeadFunctions] = HeadFunctions(
        project, head_pass, lambda cfg, params, target, target_params, h: (
            head_logits(cfg, params, target, target_params, h), h))
    what: ClassVar[str] = "the EAGLE head"
    max_lag: int = MAX_LAG  # R: how far behind the head may fall (module docstring)
    catch_up: int = CATCH_UP  # slots per catch-up pass
    stop_below: float = 0.0  # a chain ends after its first draft of confidence below this (`chain.draw_chain`)

    def __post_init__(self):
        check_dynamic_shape(self.tree)
        check_stop_below(self.stop_below, self.tree)
        if self.max_lag < 2 or self.catch_up < 1:
            raise ValueError(f"max_lag must be at least 2 and catch_up at least 1, got {self.max_lag}, {self.catch_up}")

    @property
    def reads_hidden(self) -> tuple[int, ...]:
        return self.config.feature_layers

    def check(self, target: TargetModel, mesh) -> None:
        cfg = self.config
        self._check_target(target)
        bad = [x for x in cfg.feature_layers if not (x == FINAL_NORM or 0 <= x < target.num_layers)]
        if bad:
            raise ValueError(f"{self.what} reads target layers {list(cfg.feature_layers)}; "
                             f"the target has layers 0..{target.num_layers - 1} (and FINAL_NORM -1)")
        if mesh is not None:
            check_model_axis(mesh, cfg.layer, self.what)

    def _check_target(self, target: TargetModel) -> None:
        """ValueError unless the head was built for ``target``'s hidden size and vocabulary."""
        check_head(self.tree, self.config, target, self.what)

    def _project(self, params, features: jax.Array) -> jax.Array:
        return self.head.project(self.config, params, features)

    def _pass(self, params, ctx, tokens, inputs, cache, positions, block_mask=None, defer_writes=False, pending=None):
        """The head's pass with the target of ``ctx`` (a draft or prefill context)."""
        return self.head.head_pass(self.config, params, ctx.target, ctx.target_params, tokens, inputs, cache,
                                   positions, block_mask, defer_writes, pending=pending)

    def _logits(self, params, ctx, h: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self.head.logits(self.config, params, ctx.target, ctx.target_params, h)

    def _layer(self) -> LlamaConfig:
        return self.config.layer

    def init(self, params, prefill: PrefillContext) -> EagleState:
        """The head's cache over the prompt (input j: token j + 1 with the prompt's feature j), and the ring of
        the prompt's latest features."""
        prompts = prefill.prompts
        batch, width = prompts.shape
        inputs = self._project(params, prefill.features)  # f32[B,P,H]
        following = jnp.pad(prompts[:, 1:], ((0, 0), (0, 1)))
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None, :], (batch, width))
        _, cache = self._pass(params, prefill, following, inputs, self._layer().init_cache(batch, prefill.capacity),
                              positions)
        ring = jnp.arange(self.max_lag)[None, :]  # the latest prompt index j < prompt_lens with j % R == row
        index = prefill.prompt_lens[:, None] - 1 - (prefill.prompt_lens[:, None] - 1 - ring) % self.max_lag
        features = jnp.take_along_axis(inputs, jnp.clip(index, 0, width - 1)[:, :, None], axis=1)
        first_round = jnp.maximum(prefill.prompt_lens - 2, 0)  # the first round's block starts at slot n - 2
        return EagleState(cache=cache.with_lengths(first_round), features=features)

    def resume(self, params, state: EagleState, ctx: DraftContext, drafting: jax.Array | None) -> EagleState:
        """The last verify pass's features into the ring (every round: the round's block reads them there);
        then, before a round that drafts (or when a row would otherwise fall out of the ring's reach), passes of
        ``catch_up`` slots up to the round's block (module docstring)."""
        n, emitted, width = ctx.num_tokens, ctx.last_emit, ctx.features.shape[1]
        need = width if drafting is None else 2 * width  # a lag bound of one verify pass, or of two under a policy
        if self.max_lag < need:
            raise ValueError(f"max_lag {self.max_lag} must be at least {need}: the widest verify pass ({width}), "
                             "twice that under a shape policy")
        features = self._remember(state.features, self._project(params, ctx.features), n - 1 - emitted, emitted)
        if drafting is None:  # a fixed gamma: every round drafts, the head never falls behind
            return state.replace(features=features)
        block = _block_start(n, emitted)

        def behind(cache):
            lacking = (ctx.room > 0) & (cache.lengths < block)
            out_of_reach = n + width - 1 - cache.lengths > self.max_lag  # after the next round's features
            return jnp.any(lacking & (drafting | out_of_reach))

        def catch_up(cache):  # read in a conditional, written after it (`kv_cache.ordered_read`)
            slots = cache.lengths[:, None] + jnp.arange(self.catch_up)[None, :]
            tokens = jnp.take_along_axis(ctx.tokens, jnp.minimum(slots + 1, ctx.tokens.shape[1] - 1), axis=1)
            inputs = jnp.take_along_axis(features, (slots % self.max_lag)[:, :, None], axis=1)
            written = ordered_read(lambda c: self._pass(params, ctx, tokens, inputs, c, slots, defer_writes=True)[1],
                                   cache)
            lengths = jnp.minimum(cache.lengths + self.catch_up, jnp.maximum(block, cache.lengths))
            return cache.write_block(written).with_lengths(lengths)

        return EagleState(cache=jax.lax.while_loop(behind, catch_up, state.cache), features=features)

    def _remember(self, ring: jax.Array, inputs: jax.Array, first: jax.Array, count: jax.Array) -> jax.Array:
        """``ring`` f32[B,R,H] with ``inputs[:, s]`` (f32[B,S,H]) at row ``(first + s) % R`` for ``s < count``."""
        s = jnp.arange(inputs.shape[1])[None, :]
        rows = jnp.where(s < count[:, None], (first[:, None] + s) % self.max_lag, self.max_lag)  # R: dropped
        return ring.at[jnp.arange(ring.shape[0])[:, None], rows].set(inputs.astype(ring.dtype), mode="drop")

    def _reencode(self, params, state: EagleState, ctx: DraftContext) -> tuple[jax.Array, KVBlock]:
        """The round's block pass (module docstring, step 1), reading the cache (``lengths`` = the block's first
        slot): ``(h f32[B,H] at slot n - 2, the block's keys/values, G + 1 slots from its first)``."""
        block = jnp.maximum(ctx.last_emit, 1)  # slots re-encoded: n-1-block .. n-2
        slots = state.cache.lengths[:, None] + jnp.arange(ctx.features.shape[1])[None, :]  # G + 1: one verify pass
        tokens = jnp.take_along_axis(ctx.tokens, jnp.minimum(slots + 1, ctx.tokens.shape[1] - 1), axis=1)
        # the ring holds the features of slots n-1-e .. n-2 (`resume`), or for e = 0 the prompt's at n - 2 (`init`)
        inputs = jnp.take_along_axis(state.features, (slots % self.max_lag)[:, :, None], axis=1)
        h, written = self._pass(params, ctx, tokens, inputs, state.cache, slots, defer_writes=True)
        newest = lambda a: jnp.take_along_axis(a, (block - 1)[:, None, None], axis=1)[:, 0]  # noqa: E731
        return newest(h), written

    def propose(self, params, state: EagleState, ctx: DraftContext, gamma: int):
        """``(Proposal, CacheWrite)``: the head's cache is only read (in a conditional, `kv_cache.ordered_read`);
        the keys/values of the block and of the fed drafts come back for `settle` to write."""
        n = ctx.num_tokens
        start = _block_start(n, ctx.last_emit)
        if gamma == 0:  # the head falls behind (module docstring): nothing written
            nowhere = jnp.full_like(start, state.cache.capacity)
            return (empty_proposal(n.shape[0], tree=self.tree is not None),
                    CacheWrite(self._layer().empty_block(n.shape[0], 1), nowhere, state.cache.lengths))
        draft = self._tree if self.tree is not None else self._chain
        proposal, block = ordered_read(lambda c: draft(params, state.replace(cache=c), ctx, gamma),
                                       state.cache.with_lengths(start))
        proposal = proposal._replace(num_draft=jnp.where(n >= 2, proposal.num_draft, 0))
        return proposal, CacheWrite(block, start, jnp.maximum(n - 1, 0))  # real features below slot n - 1

    def settle(self, params, state: EagleState, write: CacheWrite) -> EagleState:
        """The proposal's keys/values written into the head's cache."""
        return state.replace(cache=write.into(state.cache))

    def _chain(self, params, state: EagleState, ctx: DraftContext, gamma: int) -> tuple[Proposal, KVBlock]:
        """gamma drafts: the block pass, then gamma - 1 fed drafts, each attending to the cache below the block
        and to the pending keys/values of the passes before it (column c: slot ``cache.lengths`` + c)."""
        n, start = ctx.num_tokens, state.cache.lengths
        h_last, written = self._reencode(params, state, ctx)  # h_last predicts token n - 1's feature
        first, fed = self._logits(params, ctx, h_last)
        width = ctx.features.shape[1] + gamma - 1  # the block's G + 1 columns, then the drafts fed after it
        pending = self._layer().empty_block(n.shape[0], width).insert(written, jnp.zeros_like(start))

        def feed(carry, token, step):  # draft step + 1 (sequence index n + step) at slot n - 1 + step
            pending, fed = carry
            column = n - 1 + step - start
            seen = jnp.arange(width)[None, None, :] < column[:, None, None]  # the block's real slots, the drafts
            h, new = self._pass(params, ctx, token[:, None], fed[:, None], state.cache, (n - 1 + step)[:, None],
                                defer_writes=True, pending=(pending, seen))
            logits, fed = self._logits(params, ctx, h[:, 0])
            return logits, (pending.insert(new, column), fed)

        proposal, (pending, _) = draw_chain(ctx, gamma, first, feed, (pending, fed), self._layer().vocab_size,
                                            params.get("vocab_map"), stop_below=self.stop_below)
        return proposal, pending

    def _tree(self, params, state: EagleState, ctx: DraftContext, nodes: int) -> tuple[Proposal, KVBlock]:
        """EAGLE-2's dynamic tree of ``nodes`` nodes (`drafters.dynamic_tree`) over the block pass: each fed
        node's input is its parent's fed-back output, under the ancestor mask; only the block is written."""
        n, start = ctx.num_tokens, state.cache.lengths
        h_last, written = self._reencode(params, state, ctx)
        first, fed = self._logits(params, ctx, h_last)
        block_slots = jnp.arange(ctx.features.shape[1])[None, None, :] < (n - 1 - start)[:, None, None]

        def expand(tokens, mask, depth, inputs):
            seen = jnp.broadcast_to(block_slots, (tokens.shape[0], tokens.shape[1], block_slots.shape[2]))
            h, _ = self._pass(params, ctx, tokens, inputs, state.cache, n[:, None] - 2 + depth, mask,
                              defer_writes=True, pending=(written, seen))
            return self._logits(params, ctx, h[:, -self.tree.topk:])

        vocab_map = params.get("vocab_map")
        return grow_dynamic_tree(self.tree, nodes, first, fed, expand, vocab_map, ctx.grammar,
                                 drafter_sampling(ctx, vocab_map, self._layer().vocab_size)), written
