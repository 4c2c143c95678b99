"""Tie-aware comparison of greedy outputs (docs/design.md section 6).

Greedy speculative decoding and plain decoding (or two implementations) may
part ways where the target's top-2 logits are nearly tied: the verify pass
reduces in another shape than a 1-token step. A divergence is accepted only
where the target's top-2 margin, on the reference path, is below `tol`. A pure
length mismatch (one output a strict prefix of the other) is never accepted:
the stop rules must agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.models.llama import forward

DEFAULT_TOLERANCE = 5e-3  # logits; fp32 shape-dependent noise on SmolLM2-135M is ~1e-5..1e-4
# A near-tie per weight dtype: two bfloat16 evaluations of one logit differ by up to 0.05, so a flip
# needs a margin of at most twice that (docs/models.md, "Weight dtype").
TOLERANCE = {"float32": DEFAULT_TOLERANCE, "bfloat16": 0.1}


@dataclasses.dataclass(frozen=True)
class Comparison:
    exact: bool  # identical sequences
    first_divergence: int | None  # index of the first differing token (or the shorter length)
    margin: float | None  # target's top-2 margin at the divergence (None: identical or length mismatch)
    ok: bool  # exact, or diverged first at a near-tie (margin < tol)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where the lists differ (a length mismatch counts at the shorter length); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_greedy(reference: Sequence[int], candidate: Sequence[int], margins: Sequence[float],
                   tol: float = DEFAULT_TOLERANCE) -> Comparison:
    """margins[i]: the target's top-2 logit margin where it predicted reference[i]."""
    index = first_divergence(reference, candidate)
    if index is None:
        return Comparison(True, None, None, True)
    if index >= min(len(reference), len(candidate)):
        return Comparison(False, index, None, False)
    margin = float(margins[index])
    return Comparison(False, index, margin, margin < tol)


def top2_margin(logits: jax.Array) -> jax.Array:
    """f32[..., V] -> f32[...]: largest minus second-largest logit."""
    top2 = jax.lax.top_k(logits.astype(jnp.float32), 2)[0]
    return top2[..., 0] - top2[..., 1]


_forward = jax.jit(forward, static_argnums=0)


def teacher_forced_logits(config, params, prompt: Sequence[int], continuation: Sequence[int]) -> jax.Array:
    """f32[len(continuation), V]: the target's logits where it predicts each continuation token.

    One forward pass over prompt + continuation, padded to a power of two (one compile per bucket).
    """
    sequence = list(prompt) + list(continuation)
    width = 1 << max(4, (len(sequence) - 1).bit_length())
    tokens = np.zeros((1, width), np.int32)
    tokens[0, : len(sequence)] = sequence
    logits, _ = _forward(config, params, jnp.asarray(tokens), config.init_cache(1, width))
    start = len(prompt) - 1
    return logits[0, start : start + len(continuation)]


def teacher_forced_margins(config, params, prompt: Sequence[int], continuation: Sequence[int]) -> np.ndarray:
    """f32[len(continuation)]: the target's top-2 margin where it predicts each continuation token."""
    return np.asarray(top2_margin(teacher_forced_logits(config, params, prompt, continuation)))


def logprob_sum(config, params, prompts, continuations) -> float:
    """The summed log-probability of every continuation token under the target's raw law (``log_softmax``
    of its logits, teacher-forced): a decoder that keeps the law keeps its mean per token."""
    total = 0.0
    for prompt, continuation in zip(prompts, continuations):
        if continuation:
            logp = jax.nn.log_softmax(teacher_forced_logits(config, params, prompt, continuation), axis=-1)
            total += float(jnp.take_along_axis(logp, jnp.asarray(continuation)[:, None], axis=-1).sum())
    return total


def compare_rows(config, params, prompts, references, candidates,
                 tol: float | None = None) -> tuple[float, list[Comparison]]:
    """Compares each candidate row with its reference; returns (exact-match rate, comparisons). ``tol``
    None: the near-tie bound of the model's weight dtype (`TOLERANCE`)."""
    tol = TOLERANCE[config.dtype] if tol is None else tol
    rows = []
    for prompt, ref, cand in zip(prompts, references, candidates):
        margins = teacher_forced_margins(config, params, prompt, ref) if ref != cand else ()
        rows.append(compare_greedy(ref, cand, margins, tol))
    return sum(r.exact for r in rows) / max(len(rows), 1), rows
