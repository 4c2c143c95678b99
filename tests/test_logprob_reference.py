"""Log-probabilities against transformers' `compute_transition_scores` (fixture from
scripts/make_logprob_reference.py): the tiny Qwen2 of tests/hf_family_weights.py (default suite) and
SmolLM2-135M-Instruct (slow), plain and speculative decoding, each emitted token's log-probability and
its top alternatives."""

from __future__ import annotations

import functools
import json
import pathlib

import jax
import numpy as np
import pytest

import hf_family_weights as fw
from specdec_jax.drafters import oracle_drafter
from specdec_jax.engine import generate
from specdec_jax.models import Llama, load_model
from specdec_jax.models.loading import hf_arrays, hf_config
from test_hf_families import hub_form

FIXTURE = json.loads((pathlib.Path(__file__).parent / "fixtures" / "logprob_reference.json").read_text())
TOP = 5
TOLERANCE = {"qwen2": 1e-4, "smollm2": 5e-4}  # measured at most 1.5e-6 (float64 reference) and 1.4e-4 (float32)


@pytest.fixture(scope="module", autouse=True)
def full_precision_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


@functools.cache
def tiny_qwen2() -> Llama:
    record = FIXTURE["qwen2"]
    weights = fw.state_dict(record["config"])
    assert fw.checksum(weights) == record["checksum"], "regenerated weights differ: rerun the fixture script"
    cfg = hf_config(hub_form(record["config"]), "fixture qwen2")
    return Llama.from_arrays(cfg, hf_arrays(cfg, weights))


def check_against_transformers(name: str, target, drafter=None, gamma=None) -> None:
    rows = FIXTURE[name]["rows"]
    new = len(rows[0]["tokens"])
    out = generate(target, [r["prompt"] for r in rows], drafter, gamma=gamma, max_new_tokens=new, logprobs=TOP)
    tol = TOLERANCE[name]
    for b, row in enumerate(rows):
        assert out.tokens[b] == row["tokens"], (name, b)
        np.testing.assert_allclose(out.logprobs[b], row["logprobs"], atol=tol)
        ids, logprobs = out.target_top[b]
        np.testing.assert_allclose(logprobs, row["top_logprobs"], atol=tol)
        ref_ids, ref_logprobs = np.asarray(row["top_ids"]), np.asarray(row["top_logprobs"])
        distinct = np.diff(-ref_logprobs, axis=1) > 10 * tol  # ranks apart by more than the tolerance
        assert np.all((ids[:, :-1] == ref_ids[:, :-1])[distinct] & (ids[:, 1:] == ref_ids[:, 1:])[distinct]), (name, b)
    if drafter is not None:
        assert out.metrics.accepted_tokens > 0, "no draft was accepted: the corrections alone were checked"


def test_the_fixture_is_not_a_near_tie():
    for name, tol in TOLERANCE.items():
        assert min(m for r in FIXTURE[name]["rows"] for m in r["margins"]) > 2 * tol, name  # each side within tol


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "oracle-drafts"])
def test_tiny_qwen2_logprobs_match_transformers(speculative):
    model = tiny_qwen2()
    drafter = oracle_drafter(model.config, model.params(), 0.7) if speculative else None
    check_against_transformers("qwen2", model, drafter, 3 if speculative else None)


@pytest.mark.slow
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "oracle-drafts"])
def test_smollm2_logprobs_match_transformers(speculative):
    model = load_model("smollm2-135m")
    drafter = oracle_drafter(model.config, model.model.params(), 0.7) if speculative else None
    check_against_transformers("smollm2", model, drafter, 3 if speculative else None)
