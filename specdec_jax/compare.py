"""Tie-aware comparison of greedy outputs (DESIGN section 6).

Greedy speculative decoding and plain decoding (or two implementations) may
part ways where the target's top-2 logits are nearly tied: the verify pass
reduces in another shape than a 1-token step. A divergence is accepted only
where the target's top-2 margin, on the reference path, is below `tol`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.models.llama import forward

DEFAULT_TOLERANCE = 5e-3  # logits; fp32 shape-dependent noise on SmolLM2-135M is ~1e-5..1e-4


@dataclasses.dataclass(frozen=True)
class Comparison:
    exact: bool  # identical sequences
    first_divergence: int | None  # index of the first differing token (or the shorter length)
    margin: float | None  # target's top-2 margin at the divergence
    ok: bool  # exact, or diverged first at a near-tie (margin < tol)


def compare_greedy(reference: Sequence[int], candidate: Sequence[int], margins: Sequence[float],
                   tol: float = DEFAULT_TOLERANCE) -> Comparison:
    """margins[i]: the target's top-2 logit margin where it predicted reference[i]."""
    reference, candidate = list(reference), list(candidate)
    if reference == candidate:
        return Comparison(True, None, None, True)
    n = min(len(reference), len(candidate))
    index = next((i for i in range(n) if reference[i] != candidate[i]), n)
    margin = float(margins[index]) if index < len(margins) else None
    return Comparison(False, index, margin, margin is not None and margin < tol)


def top2_margin(logits: jax.Array) -> jax.Array:
    """f32[..., V] -> f32[...]: largest minus second-largest logit."""
    top2 = jax.lax.top_k(logits.astype(jnp.float32), 2)[0]
    return top2[..., 0] - top2[..., 1]


def teacher_forced_margins(model, prompt: Sequence[int], continuation: Sequence[int]) -> np.ndarray:
    """f32[len(continuation)]: the target's top-2 margin at each continuation token, one forward pass."""
    tokens = jnp.asarray([list(prompt) + list(continuation)], jnp.int32)
    cache = model.config.init_cache(1, tokens.shape[1])
    logits, _ = jax.jit(forward, static_argnums=0)(model.config, model.params(), tokens, cache)
    start = len(prompt) - 1
    return np.asarray(top2_margin(logits[0, start : start + len(continuation)]))
