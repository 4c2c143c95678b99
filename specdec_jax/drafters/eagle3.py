"""EAGLE-3 heads as published: vLLM's speculators ``eagle3`` model and SafeAILab's original layout
(docs/drafters.md "Published heads"; loaded by `drafters.published`).

The head reads m target hidden states (`Eagle3Config.feature_layers`, `specdec_jax.target`
indices) of each token, ``g_j f32[m*Ht]``, and projects them once::

    x_j = fc(fc_norm_i(chunk_i(g_j)) ...)        fc_norm: one RMSNorm per chunk (optional)
    x_j = fc(input_norm(g_j))                    norm_before_fc (optional); else fc(g_j)

Its first decoder layer attends from ``a = concat(input_layernorm(embed(token_{j+1})),
hidden_norm(x_j))`` (q/k/v of input width 2H) and adds to the residual ``x_j`` (``hidden_norm(x_j)``
with ``norm_before_residual``); further layers are standard (`models.llama.run_layers`). With ``h``
the last layer's output, the logits of token j + 2 are ``lm_head(norm(h))`` over the draft vocabulary
(`vocab_map`: logit d is target id ``d + d2t[d]``), and the next draft step is fed ``h`` in place of
``x`` (``norm(h)`` with ``norm_output``; the fc is not applied again). Qwen3-type heads normalise each
head of q and k (``LlamaConfig.qk_norm``); the head has its own RoPE theta and scaling.

Slots, rounds, chains and EAGLE-2 dynamic trees are those of `drafters.eagle` (its module
docstring): head cache slot j holds input j, a round re-encodes the tokens the last verify pass
committed from the target's real features, then feeds the head's own outputs.

Weights (H the head's width, Ht the target's, n draft layers; matrices ``[out, in]`` as Hugging Face's)::

    fc [H, m*Ht], input_norm [m*Ht] (norm_before_fc), fc_norm [m, Ht] (fc_norm), hidden_norm [H],
    attn_norm, wq [1, N*D, 2H], wk, wv [1, K*D, 2H], wo, mlp_norm, w_gate, w_up, w_down [1, ...],
    bq, bk, bv (attention_bias), q_norm, k_norm (qk_norm): the first layer, as `models.llama`;
    rest: {the n - 1 further layers in `models.llama`'s stacked layout} (n > 1 only),
    norm [H], lm_head [Vo, H], vocab_map i32[Vo] (Vo < V only), embed [V, H] (own_embedding only)
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from specdec_jax.drafters.base import check_tree_topk
from specdec_jax.drafters.eagle import EagleDrafter, HeadFunctions
from specdec_jax.kv_cache import KVBlock, KVCache
from specdec_jax.models.layers import with_pending
from specdec_jax.models.llama import (LlamaConfig, attention, layer_params, linear, param_shapes, rms_norm,
                                      run_layers, visibility)
from specdec_jax.models.rope import apply_rope, rope_tables
from specdec_jax.target import TargetModel
from specdec_jax.token_tree import TreeShape

FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")  # speculators' variant flags


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """Static description of an EAGLE-3 head; ``layer`` is its decoder (``vocab_size`` the target's V,
    ``hidden_size`` the head's H, ``num_layers`` the draft layers, its own RoPE, qk-norm and biases)."""

    layer: LlamaConfig
    feature_layers: tuple[int, ...]  # target hidden states read (specdec_jax.target indices)
    target_hidden_size: int  # Ht
    output_vocab_size: int | None = None  # Vo < V: a reduced draft vocabulary (vocab_map); None: all V ids
    own_embedding: bool = False  # embed [V, H] saved with the head; False: the target's embedding
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False

    def __post_init__(self):
        object.__setattr__(self, "feature_layers", tuple(int(x) for x in self.feature_layers))
        if not self.feature_layers or len(set(self.feature_layers)) != len(self.feature_layers):
            raise ValueError(f"feature_layers must be distinct layer indices, got {self.feature_layers}")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm exclude each other")
        if self.output_vocab_size is not None and not 0 < self.output_vocab_size < self.layer.vocab_size:
            raise ValueError(f"output_vocab_size must be in [1, {self.layer.vocab_size}), got {self.output_vocab_size}")
        if self.layer.output_vocab_size is not None or self.layer.tie_embeddings:
            raise ValueError("the head's layer config has no output head of its own (lm_head is the head's)")

    @property
    def rest(self) -> LlamaConfig | None:
        """The further decoder layers (standard Llama layers), None for a one-layer head."""
        n = self.layer.num_layers
        return dataclasses.replace(self.layer, num_layers=n - 1) if n > 1 else None


def eagle3_shapes(cfg: Eagle3Config) -> dict[str, Any]:
    """Name -> shape of every weight (module docstring); ``rest`` maps to a dict of its own."""
    layer, h, m = cfg.layer, cfg.layer.hidden_size, len(cfg.feature_layers)
    first = dataclasses.replace(layer, num_layers=1)
    shapes = {name: shape for name, shape in param_shapes(first).items() if name in layer_params(first)}
    for name in ("wq", "wk", "wv"):
        shapes[name] = shapes[name][:2] + (2 * h,)
    shapes.update(fc=(h, m * cfg.target_hidden_size), hidden_norm=(h,), norm=(h,),
                  lm_head=(cfg.output_vocab_size or layer.vocab_size, h))
    if cfg.norm_before_fc:
        shapes["input_norm"] = (m * cfg.target_hidden_size,)
    if cfg.fc_norm:
        shapes["fc_norm"] = (m, cfg.target_hidden_size)
    if cfg.output_vocab_size is not None:
        shapes["vocab_map"] = (cfg.output_vocab_size,)
    if cfg.own_embedding:
        shapes["embed"] = (layer.vocab_size, h)
    if cfg.rest is not None:
        shapes["rest"] = {name: shape for name, shape in param_shapes(cfg.rest).items()
                          if name in layer_params(cfg.rest)}
    return shapes


def project(cfg: Eagle3Config, params, features: jax.Array) -> jax.Array:
    """f32[..., H]: target features f32[..., m, Ht] through the optional norms and the fc."""
    eps = cfg.layer.rms_norm_eps
    g = features.astype(jnp.float32)
    if cfg.fc_norm:
        g = rms_norm(g, params["fc_norm"], eps)  # [m, Ht] weights: one norm per chunk
    g = g.reshape(*g.shape[:-2], -1)
    if cfg.norm_before_fc:
        g = rms_norm(g, params["input_norm"], eps)
    return linear(g, params["fc"])


def _first_layer(cfg: Eagle3Config, params, embeds: jax.Array, x: jax.Array, cache: KVCache, cos, sin,
                 block_mask: jax.Array | None, defer_writes: bool, visible: jax.Array | None = None,
                 pending: tuple[KVBlock, jax.Array] | None = None) -> tuple[jax.Array, KVCache | KVBlock]:
    """The first decoder layer over ``embeds, x f32[B,S,H]`` (module docstring) with its one-layer ``cache``
    (``visible`` and ``pending`` as in `models.llama.run_layers`; deferred: the pass's one-layer `KVBlock`
    in the cache's place)."""
    layer, eps = cfg.layer, cfg.layer.rms_norm_eps
    w = {name: params[name][0] for name in layer_params(layer)}
    batch, steps = x.shape[:2]
    hidden = rms_norm(x, params["hidden_norm"], eps)
    a = jnp.concatenate([rms_norm(embeds, w["attn_norm"], eps), hidden], axis=-1)  # [B,S,2H]
    q, k, v = linear(a, w["wq"]), linear(a, w["wk"]), linear(a, w["wv"])
    if layer.attention_bias:
        q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
    q, k, v = (y.reshape(batch, steps, -1, layer.head_dim) for y in (q, k, v))
    if layer.qk_norm:
        q, k = rms_norm(q, w["q_norm"], eps), rms_norm(k, w["k_norm"], eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if defer_writes:  # committed slots from the cache, the fed nodes from the block (ancestors only)
        committed = jnp.arange(cache.capacity)[None, None, :] < cache.lengths[:, None, None]
        own = jnp.broadcast_to(jnp.tril(jnp.ones((steps, steps), bool))[None] if block_mask is None else block_mask,
                               (batch, steps, steps))
        attn = attention(q, cache.k[0], cache.v[0], jnp.broadcast_to(committed, (batch, steps, cache.capacity)),
                         with_pending(k, v, own, pending, 0))
        cache = KVBlock((k,), (v,))
    else:
        cache = cache.write(0, k, v)
        if visible is None:
            visible = visibility(cache.lengths, steps, cache.capacity, block_mask)
        attn = attention(q, cache.k[0], cache.v[0], visible)
    x = (hidden if cfg.norm_before_residual else x) + linear(attn.reshape(batch, steps, -1), w["wo"])
    h = rms_norm(x, w["mlp_norm"], eps)
    return x + linear(jax.nn.silu(linear(h, w["w_gate"])) * linear(h, w["w_up"]), w["w_down"]), cache


def head_pass(cfg: Eagle3Config, params, target: TargetModel, target_params, tokens: jax.Array, inputs: jax.Array,
              cache: KVCache, positions: jax.Array, block_mask: jax.Array | None = None,
              defer_writes: bool = False, visible: jax.Array | None = None,
              pending: tuple[KVBlock, jax.Array] | None = None) -> tuple[jax.Array, KVCache | KVBlock]:
    """``(h f32[B,S,H], cache)``: the decoder over ``tokens i32[B,S]`` (token j + 1 of input j) and
    ``inputs f32[B,S,H]`` (projected features or fed-back outputs) at slots ``cache.lengths + s``;
    deferred (a dynamic tree's fed nodes under ``block_mask``, or a proposal's passes with the ``pending``
    keys/values of the passes before them, as in `models.llama.run_layers`): the cache is only read, and the
    pass's keys/values come back as a `KVBlock` in its place; ``visible bool[B,S,capacity]``: which slots
    each input sees (the training-time test, `distill.kinds`)."""
    embeds = params["embed"][tokens] if cfg.own_embedding else target.embed(target_params, tokens)
    cos, sin = rope_tables(positions, cfg.layer.head_dim, cfg.layer.rope_theta, cfg.layer.rope_scaling)
    first = cache.replace(k=cache.k[:1], v=cache.v[:1])
    layer = lambda i: None if pending is None else (KVBlock(pending[0].k[i], pending[0].v[i]), pending[1])  # noqa: E731
    h, first = _first_layer(cfg, params, embeds.astype(jnp.float32), inputs, first, cos, sin, block_mask,
                            defer_writes, visible, layer(slice(0, 1)))
    if cfg.rest is None:
        return h, first
    rest = cache.replace(k=cache.k[1:], v=cache.v[1:])
    h, _, rest = run_layers(cfg.rest, params["rest"], h, rest, positions, block_mask, defer_writes=defer_writes,
                            visible=visible, pending=layer(slice(1, None)))
    joined = KVBlock if defer_writes else cache.replace
    return h, joined(k=first.k + rest.k, v=first.v + rest.v)


def head_logits(cfg: Eagle3Config, params, h: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(logits f32[..., Vo], fed f32[..., H])`` of outputs ``h f32[..., H]``: the draft-vocabulary
    logits of the next token and what the next draft step is fed."""
    normed = rms_norm(h, params["norm"], cfg.layer.rms_norm_eps)
    return linear(normed, params["lm_head"]).astype(jnp.float32), (normed if cfg.norm_output else h)


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(EagleDrafter):
    """Drafts with an EAGLE-3 head (module docstring): EAGLE's rounds (`drafters.eagle.EagleDrafter`: the
    block pass, chains, EAGLE-2's dynamic trees) with this head's projection, decoder and logits.
    params: the head's weights (not hashed)."""

    config: Eagle3Config
    params: Any = dataclasses.field(compare=False, repr=False)
    name: str = "eagle"
    tree: TreeShape | None = None
    head: ClassVar[HeadFunctions] = HeadFunctions(
        project, head_pass, lambda cfg, params, target, target_params, h: head_logits(cfg, params, h))
    what: ClassVar[str] = "the EAGLE-3 head"

    def _check_target(self, target: TargetModel) -> None:
        cfg = self.config
        check_tree_topk(self.tree, cfg.output_vocab_size or cfg.layer.vocab_size, self.what)
        if (cfg.target_hidden_size, cfg.layer.vocab_size) != (target.hidden_size, target.vocab_size):
            raise ValueError(f"the EAGLE-3 head was built for a target of hidden size {cfg.target_hidden_size} and "
                             f"vocabulary {cfg.layer.vocab_size}; this one has {target.hidden_size} and "
                             f"{target.vocab_size}")
        if not cfg.own_embedding and cfg.layer.hidden_size != target.hidden_size:
            raise ValueError(f"the EAGLE-3 head (width {cfg.layer.hidden_size}) has no embedding of its own and "
                             f"cannot use the target's (width {target.hidden_size})")
