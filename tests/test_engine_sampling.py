"""Sampling with truncation through the engine, and mixed greedy / sampled batches.

1. The law under temperature 0.7, top-k 4, top-p 0.9 (a 6-token toy vocabulary).
   The exact law of the first NEW = 3 generated tokens comes from
   `specdec_jax.audit.sequence_law`, which applies the transforms in float64
   numpy on the host, written independently of `specdec_jax.sampling.process_logits`.
   The prompt is chosen so that the target's processed law p and the draft's
   processed law q have different supports at the first position (each has a
   token the other excludes, and they share one): the draft proposes tokens p
   forbids (they must always be rejected) and p needs tokens q never proposes
   (they can only come from the residual max(p - q, 0)). N = 16,384 rows of the
   same prompt (65,536 in the slow tier, as in tests/test_engine_law.py; distinct row ids:
   independent draws) go through one `generate` call, speculative (a draft model,
   gamma 2) and plain (gamma 0, the control); chi-square over the 216 cells at
   significance 1e-4, and no draw may land on a cell of probability 0
   (`audit.chi_square` returns p = 0 for any such draw).

2. A ragged batch on tiny-random mixing greedy rows (0, 2) and sampled rows
   (1, 3: temperature 0.8, top-p 0.9), decoded speculatively with the n-gram
   drafter and with a draft model at gamma 4: greedy rows equal plain greedy
   decoding of their prompt alone, sampled rows equal their prompt decoded alone
   with the same seed and row id. A row must not depend on its neighbours, nor
   on their sampling settings.

Every run is cached per process (functools.cache), and the toy runs share one
capacity (16) and batch bucket.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from specdec_jax.audit import (chi_square, continuation_codes, continuation_logits, noisy_copy, processed_law,
                               sequence_law)
from specdec_jax.compare import compare_rows
from specdec_jax.drafters import ModelDrafter, NgramDrafter
from specdec_jax.engine import generate
from specdec_jax.models import Llama, LlamaConfig, load_model, random_llama
from specdec_jax.sampling import RowSampling, SamplingParams, process_logits
from test_engine_law import N, law_cases

# ----------------------------------------------------------------------------
# 1. The truncated sampling law, end to end

V = 6
NEW = 3
SIGNIFICANCE = 1e-4
TRUNCATION = dict(temperature=0.7, top_k=4, top_p=0.9)
SAMPLING = SamplingParams(**TRUNCATION)
# At the first position p keeps {1, 4, 5} and q keeps {1, 2, 5} (test_supports_of_p_and_q_differ);
# top-p cuts below top-k in most rows of the law's 3 positions; 38 cells expect >= 5 draws.
PROMPT = [3, 5, 5, 1, 3]
CONFIG = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                     num_kv_heads=1, head_dim=8)
# The engine computes in float32 and through other shapes than the reference's teacher-forced
# pass: every top-k / top-p decision of p must be clear of its threshold by far more than that.
MIN_MARGIN = 1e-4
HEAD_SCALE = 0.5  # a flatter target than random_llama's: the truncated law spreads over more cells


@functools.cache
def target() -> Llama:
    arrays = {k: np.asarray(v) for k, v in random_llama(CONFIG, 0).arrays().items()}
    arrays["lm_head"] = (HEAD_SCALE * arrays["lm_head"]).astype(np.float32)
    return Llama.from_arrays(CONFIG, arrays)


@functools.cache
def draft() -> Llama:
    """The target's weights plus noise (as tests/test_engine_law.py): often right, its own law."""
    return noisy_copy(target())


@functools.cache
def reference_law(model: str = "target", temperature: float = 0.7, top_k: int = 4,
                  top_p: float = 0.9) -> tuple[np.ndarray, float]:
    """(f64[216] law of x1 x2 x3, smallest top-k / top-p decision margin) from the float64 reference."""
    params = {"target": target, "draft": draft}[model]().params()
    law, margin = sequence_law(CONFIG, params, PROMPT, NEW, temperature=temperature, top_k=top_k, top_p=top_p,
                               return_margin=True)
    assert law.shape == (V**NEW,) and abs(law.sum() - 1) < 1e-9
    return law, margin


@functools.cache
def samples(drafter: str, gamma: int, seed: int, rows: int = N):
    """(i64[rows] cell of each row's first 3 tokens, metrics) of one batched `generate` call."""
    make = {"model": lambda: ModelDrafter(CONFIG, draft().params()), "none": lambda: None}[drafter]
    out = generate(target(), [PROMPT] * rows, make(), gamma=gamma, sampling=SAMPLING, max_new_tokens=NEW, seed=seed,
                   capacity=16)
    tokens = np.asarray(out.tokens)
    assert tokens.shape == (rows, NEW)
    return continuation_codes(tokens, V), out.metrics


def test_reference_processing_agrees_with_process_logits():
    """The float64 reference and `process_logits` (float32, on device) agree on random logit rows
    with many exact ties (small integers / 4), across temperatures, k and p: same support, same
    probabilities. Two independent implementations of the documented rules (ties at the k-th
    logit kept, ties with the last top-p token kept, top-p on the renormalised top-k law)
    cross-check each other; rows where a decision is within 1e-5 of its threshold are skipped,
    since float32 may legitimately decide them otherwise. Fails if either implementation breaks a
    rule (e.g. top-p on the unfiltered law, or ties dropped)."""
    rng = np.random.default_rng(0)
    logits = rng.integers(-8, 9, size=(512, 8)) / 4.0
    checked = 0
    for temperature, top_k, top_p in [(0.7, 3, 0.9), (1.0, 2, 1.0), (1.3, 0, 0.6), (0.5, 5, 0.75), (1.0, 1, 0.3)]:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        device = np.asarray(process_logits(logits.astype(np.float32), RowSampling.from_params(params, len(logits))))
        rows = [processed_law(r, temperature, top_k, top_p, return_margin=True) for r in logits]
        clear = np.array([margin > 1e-5 for _, margin in rows])
        ref = np.stack([law for law, _ in rows])
        assert clear.mean() > 0.5
        np.testing.assert_array_equal(device[clear] > 0, ref[clear] > 0)
        np.testing.assert_allclose(device[clear], ref[clear], atol=1e-6)
        checked += clear.sum()
        if top_k and top_p == 1:  # ties: some rows keep more than k tokens (the rule, not sort order)
            assert ((ref > 0).sum(-1) > top_k).any()
    assert checked > 1500


def test_supports_of_p_and_q_differ():
    """The case is the hard one: at the first generated position (the prompt's last logit row) q
    keeps a token p excludes and p keeps a token q excludes, with one token in both; top-p, not
    only top-k, trims most contexts; every decision of p is clear of its threshold, so the
    float32 engine must reproduce p's support exactly; and the law spreads over enough cells
    for the chi-square to have power. Fails if the prompt or models stop making the supports
    differ (then the law test below would no longer test that)."""
    _, target_logits = continuation_logits(CONFIG, target().params(), PROMPT, NEW)
    _, draft_logits = continuation_logits(CONFIG, draft().params(), PROMPT, NEW)
    p = processed_law(target_logits, **TRUNCATION)  # f64[216, 3, V]
    q = processed_law(draft_logits, **TRUNCATION)
    p1, q1 = p[0, 0] > 0, q[0, 0] > 0  # first position: the same for every continuation
    assert (q1 & ~p1).any() and (p1 & ~q1).any() and (p1 & q1).any(), (p[0, 0], q[0, 0])
    # Second position, over the 6 contexts x1: the supports differ in some of them too.
    p2, q2 = p[::V**2, 1] > 0, q[::V**2, 1] > 0
    assert (p2 != q2).any(axis=-1).sum() >= 2
    top_k_only = processed_law(target_logits, TRUNCATION["temperature"], TRUNCATION["top_k"], 1.0)
    assert ((top_k_only > 0).sum(-1) > (p > 0).sum(-1)).mean() > 0.5  # top-p really cuts
    assert ((p > 0).sum(-1) < V).all()  # and the law is truncated everywhere
    law, margin = reference_law()
    assert margin > MIN_MARGIN, margin
    assert (law * N >= 5).sum() >= 30  # the chi-square below has >= 30 degrees of freedom


# (id, drafter, gamma, seed, in the default suite): gamma 2 is the largest that differs with a 3-token budget.
CASES = [("model-g2", "model", 2, 21, True), ("plain", "none", 0, 22, True)]


@pytest.mark.parametrize("drafter, gamma, seed, rows", law_cases(CASES))
def test_truncated_sampling_follows_the_target_law(drafter, gamma, seed, rows):
    """Spec-decoded (and, as a control, plain) sequences follow the reference law of the target at
    temperature 0.7, top-k 4, top-p 0.9: chi-square p > 1e-4, and no draw outside p's support.
    Fails if the engine processes p differently (order of transforms, top-p on the unfiltered
    law, tie handling, temperature), if the acceptance test or residual uses another q than the
    one the draft sampled from (e.g. q before truncation: tokens q excludes would then be
    under-produced), or if the residual / bonus draws are wrong. For the speculative case the
    acceptance path must have run: drafts both accepted and rejected."""
    codes, metrics = samples(drafter, gamma, seed, rows)
    counts = np.bincount(codes, minlength=V**NEW)
    law, _ = reference_law()
    outside = counts[law == 0].sum()
    stat, dof, pvalue = chi_square(counts, law)
    print(f"{drafter} gamma {gamma}: chi2 {stat:.1f}, dof {dof}, p = {pvalue:.3g}, "
          f"acceptance {metrics.acceptance_rate:.3f}")
    assert outside == 0, f"{outside} draws outside the support of the truncated law"
    assert pvalue > SIGNIFICANCE, f"chi2 {stat:.1f} on {dof} dof, p = {pvalue:.2e}"
    if gamma:
        assert metrics.draft_tokens > rows and 0 < metrics.accepted_tokens < metrics.draft_tokens, metrics
        assert 0.1 < metrics.acceptance_rate < 0.95, metrics
    else:
        assert metrics.draft_tokens == 0 and metrics.emitted_tokens == rows * NEW, metrics


def test_truncated_law_test_has_power():
    """Power: the same speculative samples fail against nearby wrong laws: no truncation, top-p
    without top-k, temperature 1 or 0.75 with the same truncation, and the draft's processed law.
    Shows the chi-square above tells such laws apart at this N (temperature 0.75 instead of 0.7
    already gives chi2 ~ 700 on 38 dof at N, ~ 2800 at 65,536 rows)."""
    codes, _ = samples("model", 2, 21, N)  # the arguments of the model-g2 case: its cached samples
    counts = np.bincount(codes, minlength=V**NEW)
    wrong = {
        "no truncation": reference_law(top_k=0, top_p=1.0)[0],
        "top-p only": reference_law(top_k=0)[0],
        "temperature 1": reference_law(temperature=1.0)[0],
        "temperature 0.75": reference_law(temperature=0.75)[0],
        "draft's law": reference_law("draft")[0],
    }
    results = {name: chi_square(counts, law) for name, law in wrong.items()}
    print({name: f"chi2 {stat:.0f} on {dof} dof" for name, (stat, dof, _) in results.items()})
    assert all(pvalue < 1e-30 for _, _, pvalue in results.values()), results


# ----------------------------------------------------------------------------
# 2. A mixed greedy / sampled batch

MAX_NEW = 32
GAMMA = 4
CAPACITY = 64  # >= prompt bucket 16 + MAX_NEW + GAMMA + 1, for every run below
MIXED_SEED = 5
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9)
MIXED = [GREEDY, SAMPLED, GREEDY, SAMPLED]


def _mixed_prompts() -> list[list[int]]:
    rng = np.random.default_rng(77)
    return [
        rng.integers(0, 256, 4).tolist(),  # short, random
        [10, 20, 30, 40] * 3 + [10],  # 13 tokens, repetitive: the n-gram drafter matches at once
        [7, 8, 9] * 5,  # 15 tokens, repetitive
        rng.integers(0, 256, 9).tolist(),
    ]


MIXED_PROMPTS = _mixed_prompts()  # all in the 16-token prompt bucket


@functools.cache
def tiny(name: str):
    return load_model(name)


def mixed_drafter(name: str):
    if name == "ngram":
        return NgramDrafter()
    return ModelDrafter(tiny("tiny-random-draft").config, tiny("tiny-random-draft").model.params())


@functools.cache
def mixed_batch(drafter: str, seed: int = MIXED_SEED):
    return generate(tiny("tiny-random").model, MIXED_PROMPTS, mixed_drafter(drafter), gamma=GAMMA,
                    sampling=MIXED, max_new_tokens=MAX_NEW, seed=seed, capacity=CAPACITY)


@functools.cache
def solo_plain_greedy(row: int) -> list[int]:
    out = generate(tiny("tiny-random").model, [MIXED_PROMPTS[row]], None, gamma=0, sampling=GREEDY,
                   max_new_tokens=MAX_NEW, seed=MIXED_SEED, row_ids=[row], capacity=CAPACITY)
    return out.tokens[0]


@functools.cache
def solo_sampled(drafter: str, row: int, row_id: int) -> list[int]:
    out = generate(tiny("tiny-random").model, [MIXED_PROMPTS[row]], mixed_drafter(drafter), gamma=GAMMA,
                   sampling=SAMPLED, max_new_tokens=MAX_NEW, seed=MIXED_SEED, row_ids=[row_id], capacity=CAPACITY)
    return out.tokens[0]


@pytest.mark.parametrize("drafter", ["ngram", pytest.param("model", marks=pytest.mark.slow)])
def test_mixed_batch_rows_equal_solo_runs(drafter):
    """Greedy rows 0 and 2 of a speculative batch equal plain greedy decoding (gamma 0) of their
    prompt alone, token for token; sampled rows 1 and 3 equal their prompt decoded alone
    (same drafter, gamma, seed and row id). Fails if a greedy row picks up its sampled
    neighbours' randomness or settings (e.g. top-p applied to it, or its draft sampled instead of
    argmax), if verification is not lossless under greedy, or if a row's randomness depends on
    its batch position, batch size or neighbours. Also: drafts were accepted (the speculative
    path ran), the sampled rows really sample (another seed changes them, never the greedy rows),
    and the row id matters (a solo run under another id differs)."""
    batch = mixed_batch(drafter)
    assert all(len(t) == MAX_NEW for t in batch.tokens)
    assert 0 < batch.metrics.accepted_tokens < batch.metrics.draft_tokens, batch.metrics
    target = tiny("tiny-random")
    for row in (0, 2):
        alone = solo_plain_greedy(row)
        if batch.tokens[row] != alone:
            _, (cmp,) = compare_rows(target.config, target.model.params(), [MIXED_PROMPTS[row]], [alone],
                                     [batch.tokens[row]])
            pytest.fail(f"greedy row {row} differs from plain decoding alone: {cmp}")
    for row in (1, 3):
        assert batch.tokens[row] == solo_sampled(drafter, row, row), f"sampled row {row} depends on its batch"
        assert batch.tokens[row] != solo_plain_greedy(row)
    other_seed = mixed_batch(drafter, seed=MIXED_SEED + 1)
    assert [other_seed.tokens[r] == batch.tokens[r] for r in range(4)] == [True, False, True, False]
    assert solo_sampled(drafter, 1, 3) != batch.tokens[1]

