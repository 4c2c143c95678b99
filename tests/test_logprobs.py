"""Log-probs read out under speculation: each emitted token's log-prob and its top K, read from the
verify pass that scored it, are those plain decoding (a teacher-forced pass) gives the same tokens."""

from __future__ import annotations

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import engine_helpers as H
from specdec_jax import engine
from specdec_jax.cli import main
from specdec_jax.constraints import Constraint, compile_constraint
from specdec_jax.sampling import PenaltyCounts, RowSampling, SamplingParams, process_logits

K = 3
TOL = 1e-5
SAMPLED = SamplingParams(temperature=1.0)
# the processed law: a bias, a penalty, temperature and top-k (greedy row 1: its law a one-hot)
PROCESSED = [SamplingParams(temperature=0.8, top_k=8, repetition_penalty=1.2, logit_bias={65: 2.0, 7: -math.inf}),
             SamplingParams(logit_bias={65: 2.0}), SAMPLED, SamplingParams(temperature=1.5, top_k=8)]


@functools.cache
def run(drafter: str | None, sampled: bool = False, mode: str = "raw"):
    """RAGGED with logprobs K through plain decoding, the draft model (gamma 4) or the n-gram trie."""
    drafters = {None: lambda: None, "model": H.model_drafter, "trie": H.ngram_trie}
    gamma = {None: 0, "model": H.GAMMA, "trie": None}[drafter]
    sampling = (PROCESSED if mode == "processed" else SAMPLED) if sampled else SamplingParams()
    return engine.generate(H.target(), H.RAGGED, drafters[drafter](), gamma=gamma, max_new_tokens=H.MAX_NEW,
                           sampling=sampling, seed=5, logprobs=K, logprobs_mode=mode)


def teacher_logits(prompt, tokens) -> np.ndarray:
    """f32[n,V]: the target's logits that predict each of the n ``tokens`` after ``prompt``."""
    config, params = H.target().config, H.target().model.params()
    return H.teacher_logits(config, params, list(prompt) + list(tokens))[len(prompt) - 1 : -1]


def assert_read_out(out, laws) -> None:
    """Every row's reported log-probs are ``laws(row, logits)`` (f32[n,V] log-probs) of its teacher-forced
    logits: the emitted token's, and the top K's values (ids where they are not near-tied)."""
    for row, (prompt, tokens) in enumerate(zip(H.RAGGED, out.tokens)):
        logp = laws(row, prompt, tokens, teacher_logits(prompt, tokens))
        ids, top = out.target_top[row]
        assert out.logprobs[row].shape == (len(tokens),) and ids.shape == top.shape == (len(tokens), K)
        np.testing.assert_allclose(out.logprobs[row], logp[np.arange(len(tokens)), tokens], atol=TOL, rtol=0)
        np.testing.assert_allclose(top, -np.sort(-logp, axis=1)[:, :K], atol=TOL, rtol=0)
        finite = np.isfinite(top)
        np.testing.assert_allclose(np.take_along_axis(logp, ids, axis=1)[finite], top[finite], atol=TOL, rtol=0)


def raw_law(row, prompt, tokens, logits):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))


@pytest.mark.parametrize("drafter", [None, "model", "trie"])
def test_greedy_logprobs_are_the_target_raw_law_and_match_plain(drafter):
    out, plain = run(drafter), run(None)
    assert out.tokens == plain.tokens
    assert_read_out(out, raw_law)
    for a, b in zip(out.logprobs, plain.logprobs):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=0)
    if drafter is not None:
        assert out.metrics.accepted_tokens > 0 and out.metrics.draft_tokens > out.metrics.accepted_tokens


@pytest.mark.parametrize("drafter", ["model", "trie"])
def test_sampled_logprobs_are_the_target_raw_law(drafter):
    """Sampled rows take corrections and bonus tokens: each gets the log-prob plain decoding gives it."""
    out = run(drafter, sampled=True)
    assert_read_out(out, raw_law)
    assert out.metrics.draft_tokens > out.metrics.accepted_tokens > 0


def processed_law(row, prompt, tokens, logits):
    """log `process_logits` of the teacher-forced logits, penalties counted by hand over prompt + tokens before."""
    vocab, n = logits.shape[-1], len(tokens)
    history = np.concatenate([prompt, tokens]).astype(np.int64)
    context = np.stack([np.bincount(history[: len(prompt) + i], minlength=vocab) for i in range(n)])
    generated = np.stack([np.bincount(history[len(prompt) : len(prompt) + i], minlength=vocab) for i in range(n)])
    counts = PenaltyCounts(jnp.asarray(context[None], jnp.float32), jnp.asarray(generated[None], jnp.float32))
    law = process_logits(jnp.asarray(logits[None]), RowSampling.from_params(PROCESSED[row], 1), counts)[0]
    with np.errstate(divide="ignore"):  # tokens outside the law: -inf
        return np.log(np.asarray(law))


@pytest.mark.parametrize("drafter", ["model", "trie"])
def test_processed_logprobs_are_the_law_the_run_samples_from(drafter):
    """A tree's penalties count each node's own path: its recorded law is the one plain decoding samples from."""
    out = run(drafter, sampled=True, mode="processed")
    assert_read_out(out, processed_law)
    assert np.all(out.logprobs[1] == 0) and np.isneginf(out.target_top[1][1][:, 1:]).all()  # greedy: a one-hot
    assert all(np.isfinite(lp).all() for lp in out.logprobs)  # an emitted token has mass under its law
    assert 7 not in out.tokens[0]


def test_raw_logprobs_under_a_grammar_are_read_before_its_mask():
    """Raw log-probs are the target's own law even where a grammar refuses tokens: the alternatives
    include refused ones, while the emitted tokens obey the grammar."""
    tables = compile_constraint(Constraint(regex=r"[a-z]{2,6}( [a-z]{2,6}){1,4}\."), H.target().tokenizer)
    out = engine.generate(H.target(), H.RAGGED, H.model_drafter(), gamma=H.GAMMA, max_new_tokens=H.MAX_NEW,
                          grammars=tables, logprobs=K)
    assert_read_out(out, raw_law)
    allowed = set(range(ord("a"), ord("z") + 1)) | {ord(" "), ord(".")}
    assert all(set(tokens) <= allowed | set(H.target().tokenizer.stop_ids) for tokens in out.tokens)
    assert any(not set(ids.ravel()) <= allowed for ids, _ in out.target_top)


def test_logprobs_zero_reports_the_emitted_tokens_only():
    out, full = engine.generate(H.target(), H.RAGGED, max_new_tokens=H.MAX_NEW, logprobs=0), run(None)
    assert out.tokens == full.tokens
    for a, b, (ids, top) in zip(out.logprobs, full.logprobs, out.target_top):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=0)
        assert ids.shape == top.shape == (len(a), 0)


def test_logprobs_off_compile_nothing_new_and_bad_values_are_refused():
    engine.generate(H.target(), H.RAGGED, max_new_tokens=H.MAX_NEW)  # compiled here: the caches may have been emptied
    before = engine.run_loop._cache_size()
    engine.generate(H.target(), H.RAGGED, max_new_tokens=H.MAX_NEW, logprobs=None)
    assert engine.run_loop._cache_size() == before
    for bad, words in [(dict(logprobs=21), "logprobs must be None or an int in"),
                       (dict(logprobs=2, record_top_k=2), "exclude each other"),
                       (dict(logprobs=1, logprobs_mode="scaled"), "logprobs_mode must be one of")]:
        with pytest.raises(ValueError, match=words):
            engine.generate(H.target(), H.RAGGED, **bad)


def test_cli_json_reports_logprobs_per_token(tmp_path, capsys):
    out = tmp_path / "out.json"
    args = ["generate", "--model", "tiny-random", "--raw", "--max-new-tokens", "8", "--gamma", "4", "--prompt",
            "hello hello", "--logprobs", "2", "--logit-bias", "257=-inf", "--json", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["config"]["logprobs"] == 2 and report["config"]["logit_bias"] == {"257": "-inf"}
    (row,) = report["results"]
    assert 257 not in row["tokens"] and len(row["tokens"]) == 8
    assert [e["token"] for e in row["logprobs"]] == row["tokens"]
    for entry in row["logprobs"]:
        assert set(entry) == {"token", "logprob", "top"} and len(entry["top"]) == 2
        assert entry["logprob"] <= entry["top"][0][1] + TOL and entry["top"][0][1] >= entry["top"][1][1]
