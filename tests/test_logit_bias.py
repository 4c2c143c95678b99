"""The logit bias: added to the raw logits before every other transform, in the target's law and the
drafters' alike, so that speculative decoding stays lossless under it (docs/design.md section 6)."""

from __future__ import annotations

import functools
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

import engine_helpers as H
from specdec_jax import engine
from specdec_jax.audit import chi_square, continuation_codes, sequence_law
from specdec_jax.cli import main
from specdec_jax.config import run_config
from specdec_jax.drafters import ModelDrafter
from specdec_jax.sampling import PenaltyCounts, RowSampling, SamplingParams, process_logits
from test_engine_law import CONFIG, LAW_ROWS, PROMPT, SIGNIFICANCE, V, reduced_draft
from test_engine_law import target as law_target


def test_sampling_params_keep_the_bias_as_sorted_pairs_and_refuse_bad_ones():
    params = SamplingParams(logit_bias={7: 1.5, "3": "-inf"})
    assert params.logit_bias == ((3, -math.inf), (7, 1.5))
    assert params == SamplingParams(logit_bias=[(7, 1.5), (3, -math.inf)]) and hash(params)
    for bad, words in [({-1: 1.0}, "ints >= 0"), ({1: math.nan}, "finite in float32 or -inf"),
                       ({1: math.inf}, "finite in float32 or -inf"), ({1: 1e39}, "finite"), ({1: 10**400}, "finite"),
                       ([(1, 1.0), (1, 2.0)], "given twice"), ({True: 1.0}, "ints >= 0"), ([1, 2], "map token ids")]:
        with pytest.raises(ValueError, match=words):
            SamplingParams(logit_bias=bad)


def unbiased(params: SamplingParams) -> SamplingParams:
    return SamplingParams(**{**params.__dict__, "logit_bias": ()})


def test_the_bias_enters_before_penalties_temperature_and_filters():
    """process_logits with a bias = process_logits without one of the logits plus the bias (greedy and
    sampled rows, penalties, top-k); over a reduced vocabulary (`RowSampling.take`) the bias follows its
    ids, and one the reduced vocabulary lacks is dropped."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.float32)
    counts = PenaltyCounts(*(jnp.asarray(rng.integers(0, 2, (2, 3, 8)), jnp.float32) for _ in range(2)))
    rows = [SamplingParams(temperature=0.7, top_k=4, repetition_penalty=1.3, logit_bias={2: 3.0, 5: -math.inf}),
            SamplingParams(presence_penalty=0.5, logit_bias={1: 4.0})]
    dense = np.zeros((2, 1, 8), np.float32)
    dense[0, 0, [2, 5]], dense[1, 0, 1] = (3.0, -np.inf), 4.0
    biased, plain = RowSampling.from_params(rows, 2), RowSampling.from_params([unbiased(p) for p in rows], 2)
    expected = process_logits(logits + dense, plain, counts)
    np.testing.assert_allclose(process_logits(logits, biased, counts), expected, atol=1e-6)
    assert float(jnp.max(expected[0, :, 5])) == 0 and bool(jnp.all(jnp.argmax(expected[1], -1) == 1))

    ids = jnp.asarray([0, 2, 3, 5], jnp.int32)  # token 1 is not in it: row 1's bias is dropped
    dense[1, 0, 1] = 0.0
    narrow = PenaltyCounts(*(c[..., ids] for c in counts))
    np.testing.assert_allclose(process_logits(logits[:, :, ids], biased.take(ids, 8), narrow),
                               process_logits((logits + dense)[:, :, ids], plain, narrow), atol=1e-6)


@functools.cache
def biased_rows() -> list[SamplingParams]:
    """Per row of RAGGED: ban the first token plain decoding gives row 0; boost a token in row 1; ban the
    first two of row 2; no bias in row 3 (K = 2 pairs per row)."""
    free = H.reference_no_eos().tokens
    return [SamplingParams(logit_bias={free[0][0]: -math.inf}), SamplingParams(logit_bias={65: 8.0, 66: 2.0}),
            SamplingParams(logit_bias={free[2][0]: -math.inf, free[2][1]: -math.inf}), SamplingParams()]


@functools.cache
def biased_run(drafter: str | None):
    drafters = {None: lambda: None, "model": H.model_drafter, "trie": H.ngram_trie}
    gamma = {None: 0, "model": H.GAMMA, "trie": None}[drafter]
    return engine.generate(H.target(), H.RAGGED, drafters[drafter](), gamma=gamma, max_new_tokens=H.MAX_NEW,
                           sampling=biased_rows())


def test_a_ban_changes_plain_decoding_and_leaves_unbiased_rows_alone():
    free, out = H.reference_no_eos().tokens, biased_run(None).tokens
    assert out[0][0] != free[0][0] and free[0][0] not in out[0]
    assert not {free[2][0], free[2][1]} & set(out[2])
    assert out[1] != free[1] and 65 in out[1] and len(set(out[1])) > 1  # boosted, not forced
    assert out[3] == free[3]


@pytest.mark.parametrize("drafter", ["model", "trie"])
def test_greedy_spec_equals_plain_under_biases(drafter):
    out = biased_run(drafter)
    assert out.tokens == biased_run(None).tokens
    assert out.metrics.accepted_tokens > 0


def test_bias_ids_outside_the_vocabulary_are_refused(tmp_path, capsys):
    vocab = H.target().config.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias token id {vocab} is outside the vocabulary"):
        engine.generate(H.target(), H.RAGGED, sampling=SamplingParams(logit_bias={vocab: 1.0}))
    assert main(["generate", "--model", "tiny-random", "--raw", "--prompt", "hi", "--logit-bias", f"{vocab}=-inf"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "outside the vocabulary" in err
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "tiny-random", "--logit-bias", "5"])
    assert exit_info.value.code == 2 and "TOKEN=BIAS" in capsys.readouterr().err


def test_config_takes_a_map_and_reports_a_ban_json_can_hold(tmp_path):
    cfg = run_config(logit_bias={5: -math.inf, 2: 0.5}, logprobs=3)
    assert cfg.sampling.logit_bias == ((2, 0.5), (5, -math.inf)) and cfg.inputs.logprobs == 3
    flat = json.loads(json.dumps(cfg.to_dict(), allow_nan=False))
    assert flat["logit_bias"] == {"2": 0.5, "5": "-inf"}
    assert run_config(**flat) == cfg
    with pytest.raises(ValueError, match="logit_bias"):
        run_config(logit_bias={"x": 1.0})
    with pytest.raises(ValueError, match="logprobs must be an int in"):
        run_config(logprobs=21)


BIAS_LAW = {0: -math.inf, 1: 1.0, 3: -0.7}  # token 1 lies outside the reduced draft's vocabulary


@pytest.mark.parametrize("rows", LAW_ROWS)
def test_spec_sampling_follows_the_biased_target_law(rows):
    """The reduced-vocabulary draft (q moves the bias to its ids and drops token 1's) under a ban, a boost
    and a cut: the sequences follow the biased target law exactly (`test_engine_law`'s chi-square)."""
    sampling = SamplingParams(temperature=1.0, logit_bias=BIAS_LAW)
    out = engine.generate(law_target(), [PROMPT] * rows, ModelDrafter(*reduced_draft()), gamma=2, sampling=sampling,
                          max_new_tokens=3, seed=31, capacity=16)
    tokens = np.asarray(out.tokens)
    assert tokens.shape == (rows, 3) and not (tokens == 0).any()
    law = sequence_law(CONFIG, law_target().params(), PROMPT, 3, logit_bias=BIAS_LAW)
    stat, _, pvalue = chi_square(np.bincount(continuation_codes(tokens, V), minlength=V**3), law)
    assert pvalue > SIGNIFICANCE, f"chi2 {stat:.1f}, p = {pvalue:.2e}"
    assert 0.1 < out.metrics.acceptance_rate < 0.99, out.metrics
    unbiased_law = sequence_law(CONFIG, law_target().params(), PROMPT, 3)
    assert chi_square(np.bincount(continuation_codes(tokens, V), minlength=V**3), unbiased_law)[2] < 1e-30
