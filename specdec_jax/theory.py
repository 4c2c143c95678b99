"""Closed forms of speculative decoding and their Monte Carlo check.

With a per-position acceptance probability alpha (i.i.d.) and gamma drafts, the
tokens emitted per round follow a truncated geometric law with mean
`(1 - alpha^(gamma+1)) / (1 - alpha)` (Leviathan et al. 2023, eq. 1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.verify import verify_greedy


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """E[tokens emitted per round], bonus included; gamma + 1 when alpha == 1."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def tokens_per_round_std(alpha: float, gamma: int) -> float:
    """Standard deviation of the tokens emitted in one round (exact, from the law)."""
    n = np.arange(1, gamma + 2)
    probs = np.array([alpha ** (k - 1) * ((1 - alpha) if k <= gamma else 1.0) for k in n])
    mean = (n * probs).sum()
    return float(np.sqrt(((n - mean) ** 2 * probs).sum()))


@functools.partial(jax.jit, static_argnames=("gamma", "rows", "vocab"))
def simulate_tokens_per_round(key, alpha, *, gamma: int, rows: int, vocab: int = 1000) -> jax.Array:
    """Run `rows` independent rounds through `verify_greedy`; returns n_emit i32[rows].

    Each draft equals the target's argmax with probability `alpha`, else it is a
    different token, independently per position.
    """
    k_target, k_match, k_wrong = jax.random.split(key, 3)
    target = jax.random.randint(k_target, (rows, gamma + 1), 0, vocab)
    match = jax.random.bernoulli(k_match, alpha, (rows, gamma))
    offset = jax.random.randint(k_wrong, (rows, gamma), 1, vocab)
    draft = jnp.where(match, target[:, :gamma], (target[:, :gamma] + offset) % vocab)
    return verify_greedy(draft, target, jnp.full((rows,), gamma, jnp.int32)).n_emit
