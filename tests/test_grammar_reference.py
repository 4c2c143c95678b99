"""Constrained greedy decoding of SmolLM2-135M-Instruct against transformers (fixture from
scripts/make_grammar_reference.py: transformers' greedy decoding with a logits processor driven by
outlines-core's own Index, built from transformers' tokenizer; CI needs no torch).

The five prompts run as one ragged batch, each row under its own constraint, through plain and
speculative decoding. Where transformers ended at EOS (the text a whole match nothing may extend),
our row stops there with reason "grammar", without the EOS; where it ran out of tokens, our budget
is larger (its mask never binds that early) and the outputs agree up to its length.
"""

import json
import pathlib

import pytest

from specdec_jax.compare import compare_greedy
from specdec_jax.constraints import Constraint, compile_constraint
from specdec_jax.drafters import NgramDrafter
from specdec_jax.engine import generate
from specdec_jax.models import load_model

pytestmark = pytest.mark.slow  # suite time: SmolLM2 decodes 128 constrained tokens twice
FIXTURE = json.loads((pathlib.Path(__file__).parent / "fixtures" / "grammar_hf_reference.json").read_text())
RECORDS = FIXTURE["records"]
NEW = FIXTURE["meta"]["new_tokens"] + 32


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def outputs(smollm2):
    tok = smollm2.tokenizer
    tables = [compile_constraint(Constraint(**r["constraint"]), tok) for r in RECORDS]
    prompts = [r["prompt_ids"] for r in RECORDS]
    plain = generate(smollm2, prompts, max_new_tokens=NEW, stop_ids=tok.stop_ids, grammars=tables)
    spec = generate(smollm2, prompts, NgramDrafter(), gamma=4, max_new_tokens=NEW, stop_ids=tok.stop_ids,
                    grammars=tables)
    return plain, spec


def test_the_fixture_covers_both_endings(smollm2):
    eos = set(smollm2.tokenizer.stop_ids)
    ended = [r["tokens"][-1] in eos for r in RECORDS]
    assert any(ended) and not all(ended)


@pytest.mark.parametrize("mode", ["plain", "spec"])
def test_constrained_greedy_matches_transformers(smollm2, outputs, mode):
    out = outputs[0 if mode == "plain" else 1]
    eos = set(smollm2.tokenizer.stop_ids)
    for r, tokens, reason in zip(RECORDS, out.tokens, out.stop_reasons):
        reference, margins = r["tokens"], r["margins"]
        if reference[-1] in eos:  # a whole match: we stop on it, without the EOS
            assert reason == "grammar", (r["prompt"], reason)
            reference, margins = reference[:-1], margins[:-1]
        else:
            tokens = tokens[: len(reference)]
        comparison = compare_greedy(reference, tokens, margins)
        assert comparison.ok, (r["prompt"], comparison, smollm2.tokenizer.decode(tokens))
