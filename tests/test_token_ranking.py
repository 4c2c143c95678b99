"""The ids a reduced draft vocabulary keeps (`token_ranking`, `--draft-vocab-source`): the ranking of a text
source against a count in plain Python, its cache, the draft it makes, and the run settings."""

from __future__ import annotations

import collections
import json

import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax.cli import main
from specdec_jax.config import run_config
from specdec_jax.models import load_model
from specdec_jax.models.llama import forward
from specdec_jax.models.tokenizer import ByteTokenizer
from specdec_jax.runner import build_drafter
from specdec_jax.token_ranking import IDS, ranked_ids

TEXTS = ["the cat sat on the mat", "tatata", "", "héllo"]


@pytest.fixture
def source(tmp_path):
    """A .jsonl text source of `TEXTS`."""
    path = tmp_path / "texts.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS) + "\n")
    return path


def python_ranking(texts: list[str], vocab_size: int) -> list[int]:
    """Every id by its count in the byte tokens of ``texts``, most frequent first, ties by id (plain Python)."""
    counts = collections.Counter(b for t in texts for b in t.encode("utf-8"))
    return sorted(range(vocab_size), key=lambda i: (-counts[i], i))


def test_a_source_ranks_every_id_by_its_count_ties_in_id_order(cache, source):
    tok = ByteTokenizer()
    assert ranked_ids(IDS, tok, 300).tolist() == list(range(300))
    ranked = ranked_ids(str(source), tok, 300, progress=False)  # more ids than the tokenizer has: ranked last
    assert ranked.dtype == np.int32 and ranked.tolist() == python_ranking(TEXTS, 300)
    assert ranked[:3].tolist() == [ord("t"), ord("a"), ord(" ")]


def test_the_ranking_is_counted_once_and_counted_again_when_unusable(cache, source, monkeypatch, capsys):
    """A second call reads the cache (the source is not read again); a changed source is counted again; a
    corrupt cached ranking is reported in one line and counted again."""
    tok = ByteTokenizer()
    first = ranked_ids(str(source), tok, 258, progress=False)
    with monkeypatch.context() as patch:
        patch.setattr("specdec_jax.token_ranking.source_texts", lambda *a: pytest.fail("the source was read again"))
        np.testing.assert_array_equal(ranked_ids(str(source), tok, 258, progress=False), first)
    source.write_text(json.dumps({"text": "zzz"}) + "\n")
    assert ranked_ids(str(source), tok, 258, progress=False)[0] == ord("z")
    (cached,) = [p for p in (cache / "token_ranks").glob("*.npz") if np.load(p)["ranked"][0] == ord("z")]
    cached.write_bytes(cached.read_bytes()[:100])
    capsys.readouterr()
    assert ranked_ids(str(source), tok, 258, progress=False)[0] == ord("z")
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "cannot be used" in out[0] and "counting again" in out[0], out


def test_a_source_without_tokens_is_refused_in_one_line(cache, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(ValueError, match="holds no tokens"):
        ranked_ids(str(empty), ByteTokenizer(), 258, progress=False)


@pytest.mark.parametrize("order", ["first ids", "ranked"])
def test_a_reduced_head_keeps_the_ranked_ids_and_the_stop_ids_with_the_same_logits(order):
    """Logit j of the reduced draft is token vocab_map[j]: one of the first 100 ids of the ranking (or of the
    vocabulary) or a stop id, with the full model's logit of that token (tied head: rows of the embedding)."""
    full = load_model("tiny-random-draft")
    ranking = None if order == "first ids" else np.random.default_rng(0).permutation(258).astype(np.int32)
    reduced = full.with_output_vocab(100, ranking)
    kept = range(100) if ranking is None else ranking[:100].tolist()
    ids = reduced.model.arrays()["vocab_map"]
    assert ids.tolist() == sorted({*kept, *full.tokenizer.stop_ids})
    assert reduced.config.output_vocab_size == len(ids)
    tokens = jnp.asarray([[1, 2, 3, 4, 5]])
    want, _ = forward(full.config, full.model.params(), tokens, full.config.init_cache(1, 5))
    got, _ = forward(reduced.config, reduced.model.params(), tokens, reduced.config.init_cache(1, 5))
    np.testing.assert_allclose(got, np.asarray(want)[..., ids], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="reduced already"):
        reduced.with_output_vocab(50)
    with pytest.raises(ValueError, match="a ranking orders all 258 ids"):
        full.with_output_vocab(50, np.arange(100))


def test_the_run_settings_build_a_draft_over_the_sources_most_frequent_ids(cache, source):
    """`--draft-vocab 64 --draft-vocab-source FILE`: the draft model's head covers the 64 ids most frequent in the
    file and its stop ids (what plain decoding emits with such a draft: tests/test_engine_law.py, reduced draft)."""
    cfg = run_config(model="tiny-random", drafter="draft-model", draft_model="tiny-random-draft", gamma=3,
                     draft_vocab=64, draft_vocab_source=str(source))
    drafter = build_drafter(cfg, load_model("tiny-random"))
    want = sorted({*python_ranking(TEXTS, 258)[:64], *ByteTokenizer.stop_ids})
    assert np.asarray(drafter.params["vocab_map"]).tolist() == want
    assert drafter.config.output_vocab_size == len(want)


@pytest.mark.parametrize("flags, message", [
    (["--drafter", "draft-model", "--draft-model", "tiny-random-draft", "--draft-vocab-source", "sharegpt"],
     "give draft_vocab N too"),
    (["--drafter", "draft-model", "--draft-model", "tiny-random-draft", "--draft-vocab", "64",
      "--draft-vocab-source", "/nonexistent/texts.jsonl"], "is neither a name"),
])
def test_bad_draft_vocab_sources_are_one_line_and_exit_2(cache, capsys, flags, message):
    assert main(["generate", "--model", "tiny-random", "--raw", "--prompt", "x", "--max-new-tokens", "2",
                 *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
