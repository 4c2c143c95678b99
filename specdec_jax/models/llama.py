"""The decoder of the Llama family (RMSNorm, rotate-half RoPE with the frequency scalings of
`models.rope`, grouped-query attention, SwiGLU),
with the differences of Qwen2 and Qwen3 declared in :class:`LlamaConfig` rather than copied:
``attention_bias`` (Qwen2: biases on the q, k and v projections) and ``qk_norm`` (Qwen3: an
RMSNorm over each head of q and of k, before RoPE). Mistral without a sliding window is a
Llama. Everything above the decoder (target interface, hidden states, trees, heads, meshes)
sees one model type.

The forward pass is a pure function of a flat dict of stacked weight arrays,
:func:`forward`; :class:`Llama` is the ``flax.nnx`` container that owns those
arrays (random init, loading, ``nnx.split``/optimizers); ``functools.partial(forward, config)``
with :meth:`Llama.params` is a pure ``(apply_fn, params)`` pair for jitted loops.

Weight layout (``L`` layers, ``H`` hidden, ``N``/``K`` query/kv heads of size
``D``, ``I`` MLP width, ``V`` vocab). Layer matrices are ``[out, in]``, as a
Hugging Face ``nn.Linear.weight`` (stacked over layers; HF's q/k weights already
use the rotate-half RoPE order), and :func:`linear` computes ``x @ w.T``::

    embed       [V, H]          model.embed_tokens.weight
    attn_norm   [L, H]          layers.*.input_layernorm.weight
    wq          [L, N*D, H]     layers.*.self_attn.q_proj.weight
    wk          [L, K*D, H]     layers.*.self_attn.k_proj.weight
    wv          [L, K*D, H]     layers.*.self_attn.v_proj.weight
    wo          [L, H, N*D]     layers.*.self_attn.o_proj.weight
    mlp_norm    [L, H]          layers.*.post_attention_layernorm.weight
    w_gate      [L, I, H]       layers.*.mlp.gate_proj.weight
    w_up        [L, I, H]       layers.*.mlp.up_proj.weight
    w_down      [L, H, I]       layers.*.mlp.down_proj.weight
    final_norm  [H]             model.norm.weight
    lm_head     [V, H]          lm_head.weight     (absent when tie_embeddings)
    bq          [L, N*D]        layers.*.self_attn.q_proj.bias    (attention_bias)
    bk, bv      [L, K*D]        layers.*.self_attn.{k,v}_proj.bias
    q_norm      [L, D]          layers.*.self_attn.q_norm.weight  (qk_norm)
    k_norm      [L, D]          layers.*.self_attn.k_norm.weight

Why ``[out, in]`` (the head too): XLA CPU runs ``w [out, in] . x^T`` for a few rows of ``x`` at
about the cost of one matrix-vector product, where ``x @ w [in, out]`` costs a multiple of it from
2 rows on; the head matters most, a large vocabulary making it a large share of the weights. Model
and head folders that record an older layout are converted on load (`models.layouts`): folders
users trained and saved keep loading.

A draft with a reduced output vocabulary (``output_vocab_size = Vo < V``, for a
cheap head) has ``lm_head [Vo, H]`` and ``vocab_map i32[Vo]``: logit ``j`` is
token ``vocab_map[j]``. Its input embedding keeps all ``V`` rows.

:meth:`Llama.params` hands the layer weights out as tuples of ``L`` separate
arrays (``params["wq"][i]: [N*D, H]``), not stacked: XLA CPU copies a slice of a
stacked array before every matmul, a copy of every weight per decode step.
:func:`forward` accepts either form (it indexes ``params[name][i]``).

Cache semantics (docs/design.md sections 3 and 9): :func:`apply` is the target pass of
``specdec_jax.target``: input token ``s`` of row ``b`` is written at slot
``cache.lengths[b] + s`` (slots ``>= T`` are dropped, so the caller must size
``T``), rotated by ``positions[b, s]``, and query ``(b, s)`` sees the committed
slots ``< lengths[b]`` and the block slots its ``block_mask`` row allows (None:
causal). :func:`forward` is the chain special case (positions ``lengths + s``,
causal) that drafters and references use. ``lengths`` is returned unchanged.
:class:`LlamaTarget` wraps the config as the engine's ``TargetModel``.

Weights, the residual stream and the KV cache are in ``LlamaConfig.dtype``
(float32 by default, or bfloat16: :meth:`Llama.astype`); products with weights run in
that dtype, while RMSNorm statistics, RoPE angles, the attention (scores, softmax and
weighted sum, rounded once: :func:`attention`) and the output logits are computed in float32.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specdec_jax.kv_cache import KVBlock, KVCache
from specdec_jax.models.layers import attention, linear, rms_norm, visibility, with_pending
from specdec_jax.models.rope import RopeScaling, apply_rope, rope_tables
from specdec_jax.sharding import check_model_axis
from specdec_jax.target import FINAL_NORM, chain_positions

Params = dict[str, jax.Array | tuple[jax.Array, ...]]

LAYER_PARAMS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")  # every family
BIAS_PARAMS = ("bq", "bk", "bv")  # [L, out]: attention_bias
QK_NORM_PARAMS = ("q_norm", "k_norm")  # [L, D]: qk_norm
LAYER_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # [L, out, in]
DTYPES = ("float32", "bfloat16")  # weight dtypes (LlamaConfig.dtype)

# Random init: embeddings and head ~ N(0, (LOGIT_STD / sqrt(H))^2) so that the
# logits of a unit-RMS final hidden state have std ~ LOGIT_STD (a clear argmax,
# a non-uniform law); projections ~ N(0, 1 / fan_in).
LOGIT_STD = 2.0


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Static, hashable architecture description."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    output_vocab_size: int | None = None  # logits over this many ids (`vocab_map`); None: all vocab_size
    max_positions: int | None = None  # trained context length (GGUF/HF metadata); None: unknown, no limit
    attention_bias: bool = False  # biases on the q, k, v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    dtype: str = "float32"  # of the weights, the residual stream and the KV cache (one of DTYPES)
    rope_scaling: RopeScaling | None = None  # scaled RoPE frequencies (`models.rope`); None: theta's own

    def __post_init__(self):
        if isinstance(self.rope_scaling, Mapping):  # a config read back from JSON (dataclasses.asdict)
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.max_positions is not None and self.max_positions < 1:
            raise ValueError(f"max_positions must be >= 1 or None, got {self.max_positions}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("rope_theta and rms_norm_eps must be positive")
        factors = self.rope_scaling.freq_factors if self.rope_scaling is not None else ()
        if factors and len(factors) != self.head_dim // 2:
            raise ValueError(f"rope_freqs has {len(factors)} factors, head_dim {self.head_dim} needs {self.head_dim // 2}")
        if self.output_vocab_size is not None:
            if not 0 < self.output_vocab_size <= self.vocab_size:
                raise ValueError(f"output_vocab_size must be in [1, {self.vocab_size}], got {self.output_vocab_size}")
            if self.tie_embeddings:
                raise ValueError("a reduced output vocabulary needs an untied lm_head (tie_embeddings false)")

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty :class:`KVCache` shaped for this model, in its dtype."""
        return KVCache.init(self.num_layers, batch, capacity, self.num_kv_heads, self.head_dim,
                            jnp.dtype(self.dtype))

    def empty_block(self, batch: int, steps: int) -> KVBlock:
        """An empty `KVBlock` of ``steps`` tokens in this model's cache layout (a drafter's pending writes)."""
        return KVBlock.zeros(self.num_layers, batch, steps, self.num_kv_heads, self.head_dim, jnp.dtype(self.dtype))


def layer_params(cfg: LlamaConfig) -> tuple[str, ...]:
    """Names of the per-layer weights of ``cfg``'s family: `LAYER_PARAMS`, then its biases and q/k norms."""
    return LAYER_PARAMS + (BIAS_PARAMS if cfg.attention_bias else ()) + (QK_NORM_PARAMS if cfg.qk_norm else ())


def param_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every weight array (see the module docstring)."""
    L, H, I, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "embed": (V, H),
        "attn_norm": (L, H),
        "wq": (L, q_out, H),
        "wk": (L, kv_out, H),
        "wv": (L, kv_out, H),
        "wo": (L, H, q_out),
        "mlp_norm": (L, H),
        "w_gate": (L, I, H),
        "w_up": (L, I, H),
        "w_down": (L, H, I),
        "final_norm": (H,),
    }
    if cfg.output_vocab_size is not None:
        shapes["lm_head"] = (cfg.output_vocab_size, H)
        shapes["vocab_map"] = (cfg.output_vocab_size,)
    elif not cfg.tie_embeddings:
        shapes["lm_head"] = (V, H)
    if cfg.attention_bias:  # after the Llama weights, so that random Llamas keep their draws
        shapes.update(bq=(L, q_out), bk=(L, kv_out), bv=(L, kv_out))
    if cfg.qk_norm:
        shapes.update(q_norm=(L, cfg.head_dim), k_norm=(L, cfg.head_dim))
    return shapes


def init_params(cfg: LlamaConfig, key: jax.Array) -> dict[str, np.ndarray]:
    """Random float32 weights (scales in ``LOGIT_STD``'s comment); norms are ones.

    Drawn with a numpy generator seeded by the key's data: deterministic in
    ``key``, and no XLA compile per shape (threefry compiles take seconds on CPU).
    """
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)))
    embed_std = LOGIT_STD / math.sqrt(cfg.hidden_size)
    params = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm"):
            params[name] = np.ones(shape, np.float32)
            continue
        if name in BIAS_PARAMS:  # large enough to matter in the logits
            params[name] = (0.5 * rng.standard_normal(shape)).astype(np.float32)
            continue
        if name == "vocab_map":  # the first output_vocab_size ids
            params[name] = np.arange(shape[0], dtype=np.int32)
            continue
        if name in LAYER_MATRICES:  # drawn [in, out], then transposed: the draws define the random models
            drawn = 1.0 / math.sqrt(shape[-1]) * rng.standard_normal(shape[:-2] + (shape[-1], shape[-2]))
            params[name] = np.ascontiguousarray(np.swapaxes(drawn.astype(np.float32), -1, -2))
            continue
        if name == "lm_head":  # drawn [H, V], then transposed (as the layer matrices)
            params[name] = np.ascontiguousarray((embed_std * rng.standard_normal(shape[::-1])).astype(np.float32).T)
            continue
        params[name] = (embed_std * rng.standard_normal(shape)).astype(np.float32)  # embed
    return params


def apply(
    cfg: LlamaConfig,
    params: Mapping[str, jax.Array],
    tokens: jax.Array,
    cache: KVCache,
    positions: jax.Array,
    block_mask: jax.Array | None = None,
    hidden_layers: tuple[int, ...] = (),
    *,
    compute_logits: bool = True,
    defer_writes: bool = False,
    pending: tuple[KVBlock, jax.Array] | None = None,
) -> tuple[jax.Array | None, jax.Array | None, KVCache | KVBlock]:
    """The target pass of ``specdec_jax.target`` (its docstring fixes the semantics).

    ``tokens: i32[B,S]`` are written at slots ``cache.lengths[b] + s``, rotated by
    ``positions: i32[B,S]``, and attend to the committed slots plus the block slots
    that ``block_mask: bool[B,S,S]`` allows (None: causal). Returns ``(logits f32[B,S,V]``
    (``[B,S,Vo]`` with a reduced output vocabulary) or None when not compute_logits,
    ``hidden f32[len(hidden_layers),B,S,H]`` or None, cache)``; ``hidden_layers``
    entries are layer indices ``0..L-1`` (the residual stream after that layer) or
    ``FINAL_NORM`` (-1). The layer loop is unrolled (a ``lax.scan`` would slice,
    hence copy, every weight each step).

    ``pending = (block, seen)`` (with ``defer_writes`` only): keys/values of earlier passes not yet
    written to the cache (a `KVBlock` of P tokens) and which of them each query sees, ``seen:
    bool[B,S,P]``; a drafter that writes its cache once per round attends to them beside the cache
    (`drafters.model`).
    """
    for layer in hidden_layers:
        if not (layer == FINAL_NORM or 0 <= layer < cfg.num_layers):
            raise ValueError(f"hidden layer {layer} is not in 0..{cfg.num_layers - 1} or FINAL_NORM (-1)")
    x, after_layer, cache = run_layers(cfg, params, params["embed"][tokens], cache, positions, block_mask,
                                       defer_writes=defer_writes, pending=pending)
    normed = None
    if compute_logits or FINAL_NORM in hidden_layers:
        normed = after_layer[FINAL_NORM] = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    hidden = jnp.stack([after_layer[l].astype(jnp.float32) for l in hidden_layers]) if hidden_layers else None
    if not compute_logits:
        return None, hidden, cache
    return lm_head(cfg, params, normed), hidden, cache


def run_layers(cfg: LlamaConfig, params: Mapping[str, jax.Array], x: jax.Array, cache: KVCache,
               positions: jax.Array, block_mask: jax.Array | None = None, *,
               defer_writes: bool = False, visible: jax.Array | None = None,
               pending: tuple[KVBlock, jax.Array] | None = None) -> tuple[jax.Array, dict, KVCache | KVBlock]:
    """The decoder layers over input states ``x: f32[B,S,H]`` (semantics of :func:`apply`).

    Returns ``(x after the last layer, {layer index: its residual stream f32[B,S,H]}, cache)``;
    with ``defer_writes`` the cache is only read and the block's keys/values come back as a
    ``KVBlock`` instead (write them with ``cache.write_block``). ``visible bool[B,S,W]``
    (written path only) replaces `visibility`: query s sees slot j of the cache, the block
    included (an EAGLE-3 training-time-test step sees its own chain, `distill.kinds`). ``pending``
    (deferred path only): earlier passes' unwritten keys/values, as in :func:`apply`.
    Also the body of a one-layer drafter head that feeds its own inputs (EAGLE).
    """
    batch, steps = x.shape[:2]
    cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    if visible is not None and (defer_writes or block_mask is not None):
        raise ValueError("visible replaces block_mask, on the written path only")
    if pending is not None and not defer_writes:
        raise ValueError("pending keys/values go with defer_writes")
    if defer_writes:  # committed slots from the cache, the block's own tokens from the block
        visible = jnp.broadcast_to(jnp.arange(cache.capacity)[None, None, :] < cache.lengths[:, None, None],
                                   (batch, steps, cache.capacity))
        own = jnp.tril(jnp.ones((steps, steps), bool))[None] if block_mask is None else block_mask
        own = jnp.broadcast_to(own, (batch, steps, steps))
        new_k, new_v = [], []
    elif visible is None:
        visible = visibility(cache.lengths, steps, cache.capacity, block_mask)

    after_layer = {}
    for index in range(cfg.num_layers):
        w = {name: params[name][index] for name in layer_params(cfg)}
        q, k, v = _attention_inputs(cfg, w, rms_norm(x, w["attn_norm"], cfg.rms_norm_eps), cos, sin)
        if defer_writes:
            attn = attention(q, cache.k[index], cache.v[index], visible, with_pending(k, v, own, pending, index))
            new_k.append(k)
            new_v.append(v)
        else:
            cache = cache.write(index, k, v)
            attn = attention(q, cache.k[index], cache.v[index], visible)
        x = x + linear(attn.reshape(batch, steps, -1), w["wo"])
        h = rms_norm(x, w["mlp_norm"], cfg.rms_norm_eps)
        x = x + linear(jax.nn.silu(linear(h, w["w_gate"])) * linear(h, w["w_up"]), w["w_down"])
        after_layer[index] = x
    if defer_writes:
        return x, after_layer, KVBlock(tuple(new_k), tuple(new_v))
    return x, after_layer, cache


def _attention_inputs(cfg: LlamaConfig, w: Mapping[str, jax.Array], h: jax.Array, cos: jax.Array,
                      sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A layer's ``(q [B,S,N,D], k [B,S,K,D], v [B,S,K,D])`` from its normed input ``h [B,S,H]`` and its weights
    ``w``: projections (and biases), q/k norms when the family has them, RoPE on q and k."""
    batch, steps = h.shape[:2]
    q, k, v = linear(h, w["wq"]), linear(h, w["wk"]), linear(h, w["wv"])
    if cfg.attention_bias:
        q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
    q, k, v = (y.reshape(batch, steps, -1, cfg.head_dim) for y in (q, k, v))
    if cfg.qk_norm:
        q, k = rms_norm(q, w["q_norm"], cfg.rms_norm_eps), rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def split_layers(cfg: LlamaConfig, params: Mapping) -> dict:
    """``params`` with each layer weight stacked as ``[L, ...]`` turned into a tuple of L arrays, the layout
    of `Llama.params` (tuples are kept): XLA CPU runs a pass that slices layer ``i`` out of a stacked weight
    about twice as slowly as one that reads an array of its own."""
    names = set(layer_params(cfg))
    return {k: tuple(v[i] for i in range(cfg.num_layers)) if k in names and not isinstance(v, tuple) else v
            for k, v in params.items()}


def lm_head(cfg: LlamaConfig, params: Mapping[str, jax.Array], normed: jax.Array) -> jax.Array:
    """f32[B,S,V] logits (``[B,S,Vo]`` with a reduced output vocabulary) of final-norm states ``[B,S,H]``."""
    head = params["embed"] if cfg.tie_embeddings else params["lm_head"]  # [V or Vo, H]: [out, in]
    return linear(normed, head, out_dtype=jnp.float32)


def forward(
    cfg: LlamaConfig,
    params: Mapping[str, jax.Array],
    tokens: jax.Array,
    cache: KVCache,
    *,
    compute_logits: bool = True,
) -> tuple[jax.Array | None, KVCache]:
    """:func:`apply` of a chain: ``tokens: i32[B,S]`` at slots and positions ``cache.lengths[b] + s``,
    causal. Returns ``(logits or None, cache)``."""
    positions = chain_positions(cache.lengths, tokens.shape[1])
    logits, _, cache = apply(cfg, params, tokens, cache, positions, compute_logits=compute_logits)
    return logits, cache


@dataclasses.dataclass(frozen=True)
class LlamaTarget:
    """A Llama as a ``specdec_jax.target.TargetModel`` (static and hashable: only the config)."""

    config: LlamaConfig

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def max_positions(self) -> int | None:
        return self.config.max_positions

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        return self.config.init_cache(batch, capacity)

    def apply(self, params, tokens, cache, positions, block_mask=None, hidden_layers=(), *, compute_logits=True,
              defer_writes=False):
        return apply(self.config, params, tokens, cache, positions, block_mask, hidden_layers,
                     compute_logits=compute_logits, defer_writes=defer_writes)

    def embed(self, params, tokens: jax.Array) -> jax.Array:
        return params["embed"][tokens]

    def logits_of(self, params, normed: jax.Array) -> jax.Array:
        return lm_head(self.config, params, normed)

    def check_mesh(self, mesh) -> None:
        check_model_axis(mesh, self.config, "the target")


def check_params(cfg: LlamaConfig, arrays: Mapping[str, object]) -> None:
    """Raises ValueError unless ``arrays`` has exactly ``param_shapes(cfg)``."""
    expected = param_shapes(cfg)
    missing, extra = expected.keys() - arrays.keys(), arrays.keys() - expected.keys()
    if missing or extra:
        raise ValueError(
            f"weight names differ: missing {sorted(missing)}, unexpected {sorted(extra)}")
    for name, shape in expected.items():
        if tuple(np.shape(arrays[name])) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(np.shape(arrays[name]))}")


class Llama(nnx.Module):
    """``nnx`` container of the weights in :func:`param_shapes`.

    ``Llama(cfg, rngs=nnx.Rngs(seed))`` draws random weights (:func:`init_params`);
    ``Llama.from_arrays(cfg, arrays)`` wraps given arrays (dtype kept). Global
    weights are ``nnx.Param`` attributes; layer ``i``'s are ``self.layers[i][name]``,
    one ``nnx.Param`` each, so every layer weight is its own buffer. ``vocab_map``
    (reduced output vocabulary) is an integer ``nnx.Variable``, not a ``Param``.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs | None = None,
                 arrays: Mapping[str, object] | None = None):
        if (rngs is None) == (arrays is None):
            raise ValueError("pass exactly one of rngs= (random init) or arrays=")
        if arrays is None:
            arrays = init_params(config, rngs.params())
        check_params(config, arrays)
        self.config = config
        per_layer = layer_params(config)
        for name in param_shapes(config):
            if name not in per_layer:
                kind = nnx.Variable if name == "vocab_map" else nnx.Param
                setattr(self, name, kind(_in_dtype(arrays[name], config.dtype)))
        self.layers = nnx.List([
            nnx.Dict({name: nnx.Param(_in_dtype(np.asarray(arrays[name])[i], config.dtype)) for name in per_layer})
            for i in range(config.num_layers)
        ])

    @classmethod
    def from_arrays(cls, config: LlamaConfig, arrays: Mapping[str, object]) -> Llama:
        """Builds a model from ``{name: array}`` laid out as in :func:`param_shapes` (floating arrays
        cast to ``config.dtype``)."""
        return cls(config, arrays=arrays)

    def astype(self, dtype: str) -> Llama:
        """This model with its floating weights cast to ``dtype`` (one of `DTYPES`); itself if already so."""
        if dtype == self.config.dtype:
            return self
        config = dataclasses.replace(self.config, dtype=dtype)  # validates dtype
        graphdef, state = nnx.split(self)
        model = nnx.merge(graphdef, jax.tree.map(lambda x: _in_dtype(x, dtype), state))
        model.config = config
        return model

    def params(self) -> Params:
        """The weights for :func:`forward`: ``{name: array}``, layer weights as tuples of L arrays."""
        per_layer = layer_params(self.config)
        out = {name: getattr(self, name)[...] for name in param_shapes(self.config) if name not in per_layer}
        for name in per_layer:
            out[name] = tuple(layer[name][...] for layer in self.layers)
        return out

    def arrays(self) -> dict[str, np.ndarray]:
        """The weights as numpy arrays in the stacked layout of :func:`param_shapes`."""
        return {name: np.asarray(value) for name, value in self.params().items()}

    def as_target(self) -> tuple[LlamaTarget, Params]:
        """``(LlamaTarget, weights)``: what the engine runs (``specdec_jax.target``)."""
        return LlamaTarget(self.config), self.params()

    def __call__(self, tokens: jax.Array, cache: KVCache, *,
                 compute_logits: bool = True) -> tuple[jax.Array | None, KVCache]:
        """:func:`forward` with this model's weights."""
        return forward(self.config, self.params(), tokens, cache, compute_logits=compute_logits)


def _in_dtype(x, dtype: str) -> jax.Array:
    """``x`` as a jax array, cast to ``dtype`` if floating (integer arrays such as ``vocab_map`` kept)."""
    x = jnp.asarray(x)
    return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
