"""Auditing the sampling law on a toy vocabulary: the exact law of short continuations, and chi-square.

With a vocabulary of V tokens, the law of the next `new` tokens after a prompt has
V^new cells; `sequence_law` computes it exactly from one teacher-forced pass over
every continuation, and `chi_square` tests sampled continuations against it.
Used by tests/test_engine_law.py and experiments/lossless_audit.py.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.models.llama import forward


def sequence_law(config, params, prompt: list[int], new: int) -> np.ndarray:
    """f64[V^new]: probability (temperature 1) of each continuation, index sum_i x_i V^(new-1-i)."""
    vocab = config.vocab_size
    seqs = np.array([list(prompt) + list(c) for c in itertools.product(range(vocab), repeat=new)], np.int32)
    logits, _ = forward(config, params, jnp.asarray(seqs), config.init_cache(len(seqs), seqs.shape[1]))
    x = np.asarray(logits, np.float64)  # float64 on the host: jax would compute in float32
    x = x - x.max(axis=-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    start, rows = len(prompt), np.arange(len(seqs))
    return np.exp(sum(logp[rows, start - 1 + i, seqs[:, start + i]] for i in range(new)))


def continuation_codes(tokens: np.ndarray, vocab: int) -> np.ndarray:
    """i64[N]: the cell index of each row of ``tokens: [N, new]`` (the layout of `sequence_law`)."""
    tokens = np.asarray(tokens, np.int64)
    return tokens @ (vocab ** np.arange(tokens.shape[1] - 1, -1, -1))


def chi_square(counts: np.ndarray, law: np.ndarray) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of counts against law; cells expecting < 5 are merged."""
    expected = law * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        if obs[-1]:
            return float("inf"), len(obs) - 1, 0.0  # draws where the law has no mass
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    pvalue = float(jax.scipy.special.gammaincc(dof / 2, stat / 2))  # chi2 survival function
    return stat, dof, pvalue
