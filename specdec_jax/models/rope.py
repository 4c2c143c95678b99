"""Rotary position embedding: the cos/sin tables of the decoder and the frequency scalings of
long-context checkpoints (docs/models.md "RoPE scaling").

Pair ``i < D/2`` of a head (rotate-half order, as transformers' ``apply_rotary_pos_emb``) turns by
``p * inv_freq[i]`` at position ``p``, with ``inv_freq[i] = theta^(-2i/D)``. A `RopeScaling` replaces
those inverse frequencies, and multiplies cos and sin by its ``attention_factor``, by the rules of
transformers' ``modeling_rope_utils`` (``_compute_linear_scaling_rope_parameters``,
``_compute_llama3_parameters``, ``_compute_yarn_parameters``), in float32 as it computes them:

    linear      inv_freq / factor
    llama3      wavelengths 2 pi / inv_freq above original_max_positions / low_freq_factor divided by
                factor, below original_max_positions / high_freq_factor kept, between them blended
    yarn        inv_freq / factor blended with inv_freq by a linear ramp over the dimensions whose
                rotations in original_max_positions lie between beta_fast and beta_slow; cos and sin
                times attention_factor
    rope_freqs  inv_freq / freq_factors[i]: llama.cpp's ``rope_freqs`` tensor of a GGUF file (its
                converter writes the llama3 rule's divisors there)

Scaled frequencies are computed once per config on the host (`scaled_frequencies`) and enter the
jitted pass as constants.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("linear", "llama3", "yarn", "rope_freqs")
HF_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # config.json rope types this decoder computes


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency scaling (static and hashable: a field of ``LlamaConfig``). Fields its
    ``rope_type`` does not use keep their defaults."""

    rope_type: str  # one of ROPE_TYPES
    factor: float = 1.0  # linear, llama3, yarn: how much longer the scaled context is
    original_max_positions: int | None = None  # llama3, yarn: the context length before scaling
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn: rotations where the ramp starts (extrapolation only above)
    beta_slow: float = 1.0  # yarn: rotations where it ends (interpolation only below)
    truncate: bool = True  # yarn: the ramp's ends rounded outward to whole dimensions
    attention_factor: float = 1.0  # cos and sin are multiplied by it (yarn)
    freq_factors: tuple[float, ...] = ()  # rope_freqs: f32[D/2] divisors of the inverse frequencies

    def __post_init__(self):
        object.__setattr__(self, "freq_factors", tuple(float(f) for f in self.freq_factors))  # JSON gives lists
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {', '.join(ROPE_TYPES)}, got {self.rope_type!r}")
        numbers = (self.factor, self.low_freq_factor, self.high_freq_factor, self.beta_fast, self.beta_slow,
                   self.attention_factor, *self.freq_factors)
        if not all(math.isfinite(x) for x in numbers) or min(self.factor, self.attention_factor, self.beta_fast,
                                                             self.beta_slow) <= 0:
            raise ValueError(f"rope scaling {self.rope_type!r}: factors must be finite; factor, attention_factor, "
                             "beta_fast and beta_slow positive")
        if self.rope_type in ("llama3", "yarn") and not (self.original_max_positions or 0) >= 1:
            raise ValueError(f"rope scaling {self.rope_type!r} needs original_max_positions >= 1, "
                             f"got {self.original_max_positions!r}")
        if self.rope_type == "llama3" and self.high_freq_factor == self.low_freq_factor:
            raise ValueError("rope scaling 'llama3': high_freq_factor must differ from low_freq_factor (the "
                             "blend divides by their difference)")
        if (self.rope_type == "rope_freqs") != bool(self.freq_factors) or min(self.freq_factors, default=1) <= 0:
            raise ValueError("freq_factors (positive) are given exactly for rope_type 'rope_freqs'")


def rope_tables(positions: jax.Array, head_dim: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[jax.Array, jax.Array]:
    """``positions: i32[B,S]`` -> ``(cos, sin): f32[B,S,1,D]`` in rotate-half order."""
    if scaling is None:
        inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    else:
        inv_freq = jnp.asarray(scaled_frequencies(head_dim, theta, scaling))
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # f32[B,S,D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    if scaling is None or scaling.attention_factor == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * scaling.attention_factor, jnp.sin(angles) * scaling.attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates ``x: [B,S,heads,D]`` as HF ``apply_rotary_pos_emb`` (rotate_half)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x * cos + rotated * sin).astype(x.dtype)


@functools.cache
def scaled_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """f32[D/2] (read-only) inverse frequencies of ``scaling`` (module docstring), each step in float32
    as transformers computes it (its ``theta ** x`` in float32 is the double power rounded once)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    powers = (np.float64(theta) ** exponents.astype(np.float64)).astype(np.float32)  # torch's float32 pow, rounded once
    inv_freq = np.float32(1.0) / powers
    s = scaling
    if s.rope_type == "linear":
        out = inv_freq / np.float32(s.factor)
    elif s.rope_type == "rope_freqs":
        out = inv_freq / np.asarray(s.freq_factors, np.float32)
    elif s.rope_type == "llama3":
        out = _llama3(inv_freq, s)
    else:
        out = _yarn(powers, head_dim, theta, s)
    out = np.asarray(out, np.float32)
    out.setflags(write=False)
    return out


def _llama3(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """``_compute_llama3_parameters`` on ``inv_freq: f32[D/2]``."""
    factor, low, high, context = np.float32(s.factor), s.low_freq_factor, s.high_freq_factor, s.original_max_positions
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > np.float32(context / low), inv_freq / factor, inv_freq)
    smooth = (np.float32(context) / wavelen - np.float32(low)) / np.float32(high - low)
    smoothed = (np.float32(1) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < np.float32(context / high)) & ~(wavelen > np.float32(context / low))
    return np.where(medium, smoothed, scaled)


def _yarn(powers: np.ndarray, head_dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    """``_compute_yarn_parameters``' inverse frequencies from ``powers = theta^(2i/D): f32[D/2]``."""

    def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times in the original context
        return head_dim * math.log(s.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(s.beta_fast), dimension(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = np.float32(1) - ramp.astype(np.float32)
    interpolated = np.float32(1.0) / (np.float32(s.factor) * powers)
    return interpolated * (np.float32(1) - extrapolation) + (np.float32(1.0) / powers) * extrapolation


def yarn_attention_factor(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    """transformers' default yarn ``attention_factor``: ``yarn_get_mscale(factor, mscale) /
    yarn_get_mscale(factor, mscale_all_dim)`` when both are given (non-zero), else
    ``yarn_get_mscale(factor)``; ``yarn_get_mscale(s, m) = 0.1 m ln(s) + 1`` (1 for ``s <= 1``)."""

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def hf_rope_type(rope: Mapping) -> str:
    """The rope type of a config.json's RoPE settings: ``rope_type``, else the older ``type``, else default."""
    return rope.get("rope_type") or rope.get("type") or "default"


def hf_rope_scaling(rope: Mapping, hf: Mapping) -> RopeScaling | None:
    """The `RopeScaling` of a config.json (``hf``) whose RoPE settings are ``rope`` (``rope_parameters``
    and ``rope_scaling`` merged), read as transformers' ``standardize_rope_params`` and
    ``_compute_*_parameters`` read them; None for the default type. The type must be one of
    `HF_ROPE_TYPES`. A missing or non-numeric parameter, or a ``partial_rotary_factor`` other than 1,
    is a ValueError naming it."""
    kind = hf_rope_type(rope)
    if kind not in HF_ROPE_TYPES:
        raise ValueError(f"rope scaling type {kind!r} is not supported ({', '.join(HF_ROPE_TYPES)})")
    if kind == "default":
        return None

    def number(key: str, default=None, *, required: bool = False) -> float | None:
        if required and key not in rope:
            raise ValueError(f"rope scaling {kind!r} needs {key} (a number): add it to rope_scaling")
        value = rope.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"rope scaling {kind!r}: {key} must be a number, got {value!r}")
        return float(value)

    if number("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"rope scaling {kind!r} with partial_rotary_factor = {rope['partial_rotary_factor']!r} is "
                         "not supported by this decoder (it rotates whole heads)")
    if kind == "linear":
        return RopeScaling("linear", factor=number("factor", required=True))
    # a top-level original_max_position_embeddings wins over rope_scaling's, then max_position_embeddings
    context = hf.get("original_max_position_embeddings", rope.get("original_max_position_embeddings",
                                                                   hf.get("max_position_embeddings")))
    if isinstance(context, bool) or not isinstance(context, int):
        raise ValueError(f"rope scaling {kind!r} needs original_max_position_embeddings (an integer), got {context!r}")
    if kind == "llama3":
        return RopeScaling("llama3", factor=number("factor", required=True), original_max_positions=context,
                           low_freq_factor=number("low_freq_factor", required=True),
                           high_freq_factor=number("high_freq_factor", required=True))
    factor = number("factor", required=True)
    if factor is None:  # null: the ratio of the scaled context to the original one
        factor = (hf.get("max_position_embeddings") or 0) / context
    attention = number("attention_factor")
    if attention is None:
        attention = yarn_attention_factor(factor, number("mscale"), number("mscale_all_dim"))
    return RopeScaling("yarn", factor=factor, original_max_positions=context,
                       beta_fast=number("beta_fast") or 32.0, beta_slow=number("beta_slow") or 1.0,
                       truncate=bool(rope.get("truncate", True)), attention_factor=attention)
