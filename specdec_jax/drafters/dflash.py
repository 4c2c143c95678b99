"""DFlash block drafting (z-lab's "Block Diffusion for Flash Speculative Decoding"; docs/drafters.md
"DFlash"): a small drafter conditioned on the target's context features drafts a whole block in one pass.

Context: the target's hidden states of each committed token at `DFlashConfig.feature_layers`
(``g_j f32[m*Ht]``), projected once, ``c_j = hidden_norm(fc(g_j))``. Every draft layer l keeps in the
drafter's cache, at slot j (= position j), the context keys and values ``k_norm(k_proj_l(c_j))`` (rotated
at position j) and ``v_proj_l(c_j)``: the context is never run through the layers.

A round with ``n`` committed tokens (t0 at index n - 1, without target features yet) and ``e`` tokens
emitted by the last round first writes the context of the tokens the last verify pass committed
(`DraftContext.features`, slots n-1-e .. n-2; in `resume`, every round, outside the engine's per-size
switch, inside which a written cache would be copied), then, if it drafts, runs the block
``[t0, mask, ..., mask]`` (B tokens, the drafter's trained block size, at positions n-1 .. n+B-2)
embedded with the target's embedding (times ``embedding_scale``) through the draft layers (Qwen3 layers:
q/k norms, SwiGLU). A block query sees the context slots < n - 1 and every block token (bidirectional);
block keys past what the row's budget leaves (``room + 2``) are hidden, as the reference cuts its last
blocks. The final norm's output at block position i goes through the target's LM head (times
``logit_scale``, soft-capped when set) and gives the logits of draft i, i = 1 .. B - 1.
`propose(gamma)` draws gamma drafts from the first gamma of them with `chain.draw_chain` (each position's
processed law is q; greedy rows take the argmax): one pass
of the layers whatever gamma is, the LM head at gamma positions only; gamma is at most B - 1 (`max_drafts`: `--gamma auto` chooses among
lengths up to it, `engine.shape.chain_gammas`). A block smaller than the trained one (`with_block`,
`--dflash-block`) is the same pass over fewer masks. Chains only.

Weights (H the draft's width, equal to the target's; Ht the target's, m target states; draft layers in
`models.llama`'s stacked layout, q/k norms included, kept by the drafter as tuples of per-layer arrays,
`split_layers`)::

    fc [H, m*Ht], hidden_norm [H], attn_norm .. w_down, q_norm, k_norm [n_layers, ...], norm [H]
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specdec_jax.drafters.base import DraftContext, DrafterBase, PrefillContext
from specdec_jax.drafters.chain import draw_chain, empty_proposal
from specdec_jax.kv_cache import KVCache
from specdec_jax.models.llama import LlamaConfig, attention, layer_params, linear, param_shapes, rms_norm, split_layers
from specdec_jax.models.rope import apply_rope, rope_tables
from specdec_jax.sharding import check_model_axis
from specdec_jax.target import FINAL_NORM, TargetModel


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """Static description of a DFlash drafter: ``layer`` its decoder layers (``vocab_size`` the target's
    V, ``hidden_size`` H, ``qk_norm`` on), the target states it reads and its block."""

    layer: LlamaConfig
    feature_layers: tuple[int, ...]  # target hidden states read (specdec_jax.target indices)
    target_hidden_size: int  # Ht
    block_size: int  # B: t0 and B - 1 mask tokens per pass
    mask_token: int  # a target-vocabulary id
    embedding_scale: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "feature_layers", tuple(int(x) for x in self.feature_layers))
        if not self.feature_layers:
            raise ValueError("feature_layers must name at least one target layer")
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2 (t0 and one mask), got {self.block_size}")
        if not 0 <= self.mask_token < self.layer.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token} is outside the vocabulary of {self.layer.vocab_size}")
        if not self.layer.qk_norm:
            raise ValueError("DFlash layers normalise q and k (qk_norm)")


def dflash_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every weight (module docstring)."""
    layer, h = cfg.layer, cfg.layer.hidden_size
    shapes = {name: shape for name, shape in param_shapes(layer).items() if name in layer_params(layer)}
    shapes.update(fc=(h, len(cfg.feature_layers) * cfg.target_hidden_size), hidden_norm=(h,), norm=(h,))
    return shapes


def _qkv(layer: LlamaConfig, w: dict, x: jax.Array, cos, sin, queries: bool):
    """``(q or None, k, v)`` of inputs ``x f32[B,S,H]`` (heads split, q/k normed and rotated)."""
    batch, steps = x.shape[:2]
    split = lambda y: y.reshape(batch, steps, -1, layer.head_dim)  # noqa: E731
    k, v = linear(x, w["wk"]), linear(x, w["wv"])
    if layer.attention_bias:
        k, v = k + w["bk"], v + w["bv"]
    k = apply_rope(rms_norm(split(k), w["k_norm"], layer.rms_norm_eps), cos, sin)
    if not queries:
        return None, k, split(v)
    q = linear(x, w["wq"]) + (w["bq"] if layer.attention_bias else 0)
    return apply_rope(rms_norm(split(q), w["q_norm"], layer.rms_norm_eps), cos, sin), k, split(v)


def _weights(cfg: DFlashConfig, params, index: int) -> dict:
    return {name: params[name][index] for name in layer_params(cfg.layer)}


def write_context(cfg: DFlashConfig, params, cache: KVCache, features: jax.Array, positions: jax.Array) -> KVCache:
    """The cache with the context keys/values of ``features f32[B,S,m,Ht]`` (target states of S tokens at
    ``positions i32[B,S]``) written at slots ``cache.lengths + s`` of every draft layer."""
    layer = cfg.layer
    g = features.astype(jnp.float32).reshape(*features.shape[:2], -1)
    c = rms_norm(linear(g, params["fc"]), params["hidden_norm"], layer.rms_norm_eps)
    cos, sin = rope_tables(positions, layer.head_dim, layer.rope_theta, layer.rope_scaling)
    for index in range(layer.num_layers):
        _, k, v = _qkv(layer, _weights(cfg, params, index), c, cos, sin, queries=False)
        cache = cache.write(index, k, v)
    return cache


def block_logits(cfg: DFlashConfig, params, target: TargetModel, target_params, tokens: jax.Array,
                 positions: jax.Array, cache: KVCache, context: jax.Array, own: jax.Array,
                 rows: slice = slice(None)) -> jax.Array:
    """f32[B,R,V]: the logits at block positions ``rows`` (R of them; all S by default) of ``tokens i32[B,S]``
    (at ``positions``) attending to the cache slots ``context bool[B,S,T]`` allows and the block tokens
    ``own bool[B,S,S]`` allows. Only those rows go through the LM head, the pass's largest product."""
    layer, eps = cfg.layer, cfg.layer.rms_norm_eps
    batch, steps = tokens.shape
    x = target.embed(target_params, tokens).astype(jnp.float32) * cfg.embedding_scale
    cos, sin = rope_tables(positions, layer.head_dim, layer.rope_theta, layer.rope_scaling)
    for index in range(layer.num_layers):
        w = _weights(cfg, params, index)
        q, k, v = _qkv(layer, w, rms_norm(x, w["attn_norm"], eps), cos, sin, queries=True)
        attn = attention(q, cache.k[index], cache.v[index], context, (k, v, own))
        x = x + linear(attn.reshape(batch, steps, -1), w["wo"])
        h = rms_norm(x, w["mlp_norm"], eps)
        x = x + linear(jax.nn.silu(linear(h, w["w_gate"])) * linear(h, w["w_up"]), w["w_down"])
    logits = target.logits_of(target_params, rms_norm(x[:, rows], params["norm"], eps)).astype(jnp.float32)
    logits = logits * cfg.logit_scale
    return logits if cfg.softcap is None else jnp.tanh(logits / cfg.softcap) * cfg.softcap


@flax.struct.dataclass
class DFlashState:
    cache: KVCache  # context keys/values of every draft layer; slot j: committed token j


@dataclasses.dataclass(frozen=True)
class DFlashDrafter(DrafterBase):
    """Drafts a block per pass with a DFlash drafter (module docstring); chains only (`DrafterBase.tree`
    is None). params: its weights (not hashed)."""

    config: DFlashConfig
    params: Any = dataclasses.field(compare=False, repr=False)
    name: str = "dflash"

    def __post_init__(self):
        object.__setattr__(self, "params", split_layers(self.config.layer, self.params))

    @property
    def reads_hidden(self) -> tuple[int, ...]:
        return self.config.feature_layers

    @property
    def max_drafts(self) -> int:
        """B - 1: the masks of one block."""
        return self.config.block_size - 1

    def with_block(self, block: int) -> DFlashDrafter:
        """This drafter drafting blocks of ``block`` tokens (2 .. its trained size); a ValueError naming
        --dflash-block otherwise."""
        if not 2 <= block <= self.config.block_size:
            raise ValueError(f"--dflash-block {block}: a block holds t0 and at least one mask (2) and at most the "
                             f"{self.config.block_size} tokens the drafter was trained with")
        return dataclasses.replace(self, config=dataclasses.replace(self.config, block_size=block))

    def check(self, target: TargetModel, mesh) -> None:
        cfg = self.config
        sizes = (cfg.target_hidden_size, cfg.layer.hidden_size, cfg.layer.vocab_size)
        if sizes != (target.hidden_size, target.hidden_size, target.vocab_size):
            raise ValueError(f"the DFlash drafter was built for a target of hidden size {cfg.target_hidden_size} and "
                             f"vocabulary {cfg.layer.vocab_size}; this one has {target.hidden_size} and "
                             f"{target.vocab_size}")
        if not all(x == FINAL_NORM or 0 <= x < target.num_layers for x in cfg.feature_layers):
            raise ValueError(f"the DFlash drafter reads target layers {list(cfg.feature_layers)}, not all among the "
                             f"target's 0..{target.num_layers - 1} and FINAL_NORM (-1)")
        if mesh is not None:
            check_model_axis(mesh, cfg.layer, "the DFlash drafter")

    def init(self, params, prefill: PrefillContext) -> DFlashState:
        """The context of the prompt (slot j: prompt token j; padding slots are never visible)."""
        batch, width = prefill.prompts.shape
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None, :], (batch, width))
        cache = self.config.layer.init_cache(batch, prefill.capacity)
        return DFlashState(write_context(self.config, params, cache, prefill.features, positions))

    def resume(self, params, state: DFlashState, ctx: DraftContext, drafting: jax.Array | None) -> DFlashState:
        """Every round, drafting or not: the context of the tokens the last verify pass committed (slots
        n-1-e .. n-2), written before the engine's per-size switch, inside which `propose` only reads it."""
        n = ctx.num_tokens
        start = n - 1 - ctx.last_emit
        positions = start[:, None] + jnp.arange(ctx.features.shape[1], dtype=jnp.int32)[None, :]
        cache = write_context(self.config, params, state.cache.with_lengths(start), ctx.features, positions)
        return DFlashState(cache.with_lengths(n - 1))

    def propose(self, params, state: DFlashState, ctx: DraftContext, gamma: int):
        """``(Proposal, None)``: the block pass reads the context `resume` wrote; the state is unchanged."""
        cfg, n, cache = self.config, ctx.num_tokens, state.cache
        if gamma == 0:  # a round without speculation: no block pass
            return empty_proposal(n.shape[0]), None
        block = cfg.block_size
        t0 = jnp.take_along_axis(ctx.tokens, (n - 1)[:, None], axis=1)
        tokens = jnp.concatenate([t0, jnp.full((n.shape[0], block - 1), cfg.mask_token, jnp.int32)], axis=1)
        context = jnp.arange(cache.capacity)[None, None, :] < (n - 1)[:, None, None]
        context = jnp.broadcast_to(context, (n.shape[0], block, cache.capacity))
        shown = jnp.arange(block)[None, None, :] < jnp.minimum(ctx.room + 2, block)[:, None, None]
        logits = block_logits(cfg, params, ctx.target, ctx.target_params, tokens,
                              (n - 1)[:, None] + jnp.arange(block)[None, :], cache, context,
                              jnp.broadcast_to(shown, (n.shape[0], block, block)), rows=slice(1, 1 + gamma))

        def following(carry, token, index):  # the logits of draft index + 2: already computed
            return jax.lax.dynamic_index_in_dim(carry, index + 1, axis=1, keepdims=False), carry

        proposal, _ = draw_chain(ctx, gamma, logits[:, 0], following, logits, cfg.layer.vocab_size)
        return proposal, None

    def settle(self, params, state: DFlashState, update: None) -> DFlashState:
        """A proposal changes nothing: the state is `resume`'s."""
        return state
