"""Auditing the sampling law on a toy vocabulary: the exact law of short continuations, and chi-square.

With a vocabulary of V tokens, the law of the next `new` tokens after a prompt has
V^new cells; `sequence_law` computes it exactly from one teacher-forced pass over
every continuation, and `chi_square` tests sampled continuations against it.

The processed law (temperature, top-k, top-p, min-p) is applied here in float64
numpy on the host by `processed_law`, written independently of
`specdec_jax.sampling.process_logits` (one row at a time, plain sorting and
cumulative sums), so a test comparing the engine against it checks the engine's
transforms too. Rules (those `process_logits` documents): order logit bias -> temperature ->
top-k -> top-p -> min-p; top-k keeps every token whose logit ties the k-th
largest; top-p, computed on the top-k-filtered law renormalised, keeps the
smallest set of top tokens whose mass is >= top_p, plus every token tied with
the last one kept; min-p keeps tokens with prob >= min_p * max prob;
temperature 0 is a one-hot at the first argmax.

Used by tests/test_engine_law.py, tests/test_engine_sampling.py and
experiments/lossless_audit.py.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.models.llama import forward


def _process_row(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                 min_p: float) -> tuple[np.ndarray, float]:
    """(f64[V] law, margin) of one logit row; margin = the distance of the nearest top-k / top-p
    decision to its threshold (in scaled logits for top-k, in mass for top-p; inf if neither is on)."""
    x = np.asarray(logits, np.float64)
    vocab = x.size
    if temperature == 0:
        return np.eye(vocab)[int(np.argmax(x))], np.inf
    z = (x - x.max()) / temperature
    keep = np.ones(vocab, bool)
    margin = np.inf
    if 0 < top_k < vocab:
        ordered = sorted(z, reverse=True)
        kth = ordered[top_k - 1]
        keep &= z >= kth
        below = [v for v in ordered if v < kth]
        if below:
            margin = min(margin, kth - below[0])
    if top_p < 1:
        weights = np.where(keep, np.exp(z), 0.0)
        probs = weights / weights.sum()
        order = sorted(np.flatnonzero(keep), key=lambda t: -z[t])
        total, last = 0.0, None
        for t in order:  # walk down the sorted law until the mass reaches top_p
            margin = min(margin, abs(total - top_p))
            if total >= top_p:
                break
            total += probs[t]
            last = t
        keep &= z >= z[last]
    if min_p > 0:
        keep &= np.exp(z) >= min_p  # z's max is 0, so exp(z) = prob / max prob (renormalising keeps ratios)
    weights = np.where(keep, np.exp(z), 0.0)
    return weights / weights.sum(), margin


def processed_law(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                  min_p: float = 0.0, return_margin: bool = False):
    """f64[..., V]: the processed law of each logit row (rules in the module docstring), in float64.

    With return_margin, also the smallest distance of any top-k / top-p decision to its
    threshold over all rows: where it is tiny, float32 on device may decide otherwise.
    """
    x = np.asarray(logits, np.float64)
    rows = [_process_row(r, temperature, top_k, top_p, min_p) for r in x.reshape(-1, x.shape[-1])]
    law = np.stack([r[0] for r in rows]).reshape(x.shape)
    margin = min((r[1] for r in rows), default=np.inf)
    return (law, margin) if return_margin else law


def continuation_logits(config, params, prompt: list[int], new: int) -> tuple[np.ndarray, np.ndarray]:
    """(i32[V^new, len(prompt) + new] sequences, f64[V^new, new, V] logits): for every continuation
    (in the layout of `sequence_law`), the target logits that predict its tokens 1..new, from one
    teacher-forced pass."""
    vocab = config.vocab_size
    seqs = np.array([list(prompt) + list(c) for c in itertools.product(range(vocab), repeat=new)], np.int32)
    logits, _ = forward(config, params, jnp.asarray(seqs), config.init_cache(len(seqs), seqs.shape[1]))
    start = len(prompt)
    x = np.asarray(logits, np.float64)[:, start - 1 : start - 1 + new]  # float64 on the host from here
    # Rows sharing a prefix take its logits from one row (the first of its block): a batched pass
    # may round them differently per row (1e-7 here), and the law would then miss 1 by ~1e-8.
    rows = np.arange(len(seqs))
    for i in range(new):
        block = vocab ** (new - i)
        x[:, i] = x[rows // block * block, i]
    return seqs, x


def sequence_law(config, params, prompt: list[int], new: int, *, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, logit_bias: dict[int, float] | None = None,
                 return_margin: bool = False):
    """f64[V^new]: probability of each continuation, index sum_i x_i V^(new-1-i), under the processed
    law (`processed_law`; the defaults are temperature 1, no truncation: the softmax) of the logits plus
    ``logit_bias`` ({token id: bias}, -inf a ban), added first as `sampling.process_logits` does.

    With return_margin, also the `processed_law` margin over every context the law uses.
    """
    seqs, logits = continuation_logits(config, params, prompt, new)
    for token, bias in (logit_bias or {}).items():
        logits[..., token] += bias
    laws, margin = processed_law(logits, temperature, top_k, top_p, min_p, return_margin=True)
    start, rows = len(prompt), np.arange(len(seqs))
    law = np.prod([laws[rows, i, seqs[:, start + i]] for i in range(new)], axis=0)
    return (law, margin) if return_margin else law


def continuation_codes(tokens: np.ndarray, vocab: int) -> np.ndarray:
    """i64[N]: the cell index of each row of ``tokens: [N, new]`` (the layout of `sequence_law`)."""
    tokens = np.asarray(tokens, np.int64)
    return tokens @ (vocab ** np.arange(tokens.shape[1] - 1, -1, -1))


def chi_square(counts: np.ndarray, law: np.ndarray) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of counts against law; cells expecting < 5 are merged.

    Any count in a cell of probability 0 gives (inf, cells of positive probability, 0.0): merged
    into the small cells, such draws could otherwise pass unnoticed.
    """
    if counts[law == 0].any():  # a draw the law says is impossible: no merging may hide it
        return float("inf"), int((law > 0).sum()), 0.0
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


def noisy_copy(model, scale: float = 0.5, seed: int = 1):
    """A `Llama` with `model`'s weights plus Gaussian noise of `scale` times each weight's std (norms
    kept): a draft that is often right but has a law of its own, for law tests on toy models."""
    rng = np.random.default_rng(seed)
    arrays = {name: (np.asarray(w) + (0.0 if name.endswith("norm") else scale) * np.std(w)
                     * rng.standard_normal(np.shape(w))).astype(np.float32)
              for name, w in model.arrays().items()}
    return type(model).from_arrays(model.config, arrays)

