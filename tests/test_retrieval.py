"""The retrieval drafter: its datastore search against brute force, and the drafter through the engine.

- Device search (`drafters.retrieval`) on random token arrays with a few documents and their
  suffix array: `suffix_run` is the run a scan of every suffix finds, `longest_match` the longest
  suffix of the context that occurs in the data, `next_tokens` counts each candidate exactly, and
  `grow` takes a most frequent next token at every depth (ties allowed) and stops exactly where
  no occurrence has a next token. The proposals (chain and tree, with and without prompt lookup)
  on a hand-made datastore.
- The host side (`datastore`): sources to tokens and suffix array against a plain-Python build,
  the cache (reused, rebuilt when a source changes or the index is corrupt), a cut ShareGPT list,
  and one clean error line for each bad input, through `load_datastore` and the command line.
- End to end on tiny-random: greedy spec decoding equals plain decoding (chain, datastore alone,
  tree) with drafts accepted from the datastore; a row of a ragged batch equals its solo run;
  the command line runs; and (slow) stochastic verification keeps the target's law, chain and tree.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pydivsufsort import divsufsort

import engine_helpers as H
import test_engine_law as law
from specdec_jax import datastore as ds
from specdec_jax.audit import chi_square, continuation_codes
from specdec_jax.cli import main
from specdec_jax.datastore import SEP, Datastore, load_datastore, sharegpt_texts
from specdec_jax.drafters import NgramDrafter, RetrievalDrafter
from specdec_jax.drafters.retrieval import PROBES, grow, longest_match, next_tokens, suffix_run
from specdec_jax.engine import generate
from specdec_jax.replay import replay_drafter, replay_greedy
from specdec_jax.token_tree import TreeShape
from test_drafters import context

# ----------------------------------------------------------------------------
# Brute-force references over a token array (Python lists; a slice past the end is shorter,
# so it sorts before its extensions, as the device's END = -1 padding does)


def random_store(seed: int, alphabet: int = 5, sep_at_end: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, suffix array) of 6 documents over a skewed alphabet of at most 6 symbols, SEP between
    them; some documents repeat a motif, so that long matches and deep continuations occur."""
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.full(alphabet, 0.8))
    motif = rng.choice(alphabet, 12, p=weights).tolist()
    parts = []
    for length in rng.integers(15, 90, 6):
        doc = rng.choice(alphabet, int(length), p=weights).tolist()
        if rng.random() < 0.6:
            at = int(rng.integers(0, len(doc)))
            doc[at:at] = motif[: int(rng.integers(4, 13))]
        parts += doc + [SEP]
    tokens = np.asarray(parts if sep_at_end else parts[:-1], np.int32)
    return tokens, np.asarray(divsufsort(tokens), np.int32)


STORES = [(11, True), (12, False)]  # (seed, ends with SEP): the last document ends at SEP or at the end


def occurrences(data: list[int], key: list[int]) -> list[int]:
    """Every p with data[p : p + n] == key."""
    n = len(key)
    return [p for p in range(len(data) - n + 1) if data[p : p + n] == key]


def expected_run(data: list[int], key: list[int]) -> tuple[int, int]:
    """The run [lo, hi) of the sorted suffixes that begin with key: lo counts the suffixes whose
    first n symbols sort before key (no suffix array needed)."""
    n = len(key)
    lo = sum(data[p : p + n] < key for p in range(len(data)))
    return lo, lo + len(occurrences(data, key))


def next_counts(data: list[int], starts: list[int], offset: int) -> collections.Counter:
    """Counts of the symbol at start + offset over starts (past the end and SEP not counted)."""
    return collections.Counter(data[p + offset] for p in starts if p + offset < len(data) and data[p + offset] != SEP)


def check_greedy_chain(data, starts, n, tokens, present) -> tuple[int, int]:
    """Asserts that ``tokens`` / ``present`` (one row of `grow`) is a greedy continuation of the
    occurrences ``starts`` of an n-token key: at each depth a most frequent next token (ties allowed)
    whenever one is followed by more than 1/PROBES of the occurrences (which the probes then must
    see), else some next token or the end; absent for good once no occurrence has a next token.
    Returns (depths checked strictly, depths where the chain went on)."""
    strict = grown = 0
    for d, (token, here) in enumerate(zip(tokens, present)):
        counts = next_counts(data, starts, n + d)
        if not counts:  # no occurrence has a next token: the chain stops here
            assert not any(present[d:]) and not any(tokens[d:]), (d, tokens, present)
            return strict, grown
        best = max(counts.values())
        if best * PROBES > len(starts):  # the guarantee of the probes
            strict += 1
            assert here and counts[token] == best, (d, token, counts, len(starts))
        elif not here:  # a rare next token the probes missed: a stop, never a wrong count
            assert not any(present[d:]) and not any(tokens[d:]), (d, tokens, present)
            return strict, grown
        else:
            assert counts[token] > 0, (d, token, counts)
        grown += 1
        starts = [p for p in starts if p + n + d < len(data) and data[p + n + d] == token]
    return strict, grown


def random_keys(data: list[int], rng, count: int, alphabet: int, width: int):
    """Keys of length 1..width: a third cut from the data (they occur), a third cut from just before a
    document's end (SEP or the data's end: short continuations), a third random (a symbol the data
    lacks now and then), padded with junk to width."""
    keys = np.asarray(rng.integers(0, alphabet + 1, (count, width)), np.int32)
    lengths = rng.integers(1, width + 1, count)
    ends = [p for p, t in enumerate(data) if t == SEP] + [len(data)]
    for i in range(count):
        n = int(lengths[i])
        if i % 3 == 0:
            p = int(rng.integers(0, len(data) - n))
        elif i % 3 == 1:
            p = max(0, int(rng.choice(ends)) - n - int(rng.integers(0, 6)))
        else:
            continue
        keys[i, :n] = data[p : p + n]
    return keys, np.asarray(lengths, np.int32)


_suffix_run = jax.jit(suffix_run)
_next_tokens = jax.jit(next_tokens)
_grow = jax.jit(grow, static_argnums=5)
_longest_match = jax.jit(longest_match, static_argnums=(4, 5))


@pytest.mark.parametrize("seed, sep_at_end", STORES)
def test_suffix_run_is_the_run_a_scan_of_every_suffix_finds(seed, sep_at_end):
    """For 400 keys of length 1..6 the run [lo, hi) holds exactly the suffixes that begin with the
    key, and lo is where the key would sort (so an empty run is lo == hi at that place)."""
    tokens, suffixes = random_store(seed, sep_at_end=sep_at_end)
    data = tokens.tolist()
    keys, lengths = random_keys(data, np.random.default_rng(seed), 400, 5, 6)
    lo, hi = jax.device_get(_suffix_run(jnp.asarray(tokens), jnp.asarray(suffixes), jnp.asarray(keys),
                                        jnp.asarray(lengths)))
    empty = 0
    for i, (key, n) in enumerate(zip(keys.tolist(), lengths.tolist())):
        key = key[:n]
        assert (lo[i], hi[i]) == expected_run(data, key), (key, lo[i], hi[i])
        assert sorted(suffixes[lo[i] : hi[i]].tolist()) == occurrences(data, key)
        empty += lo[i] == hi[i]
    assert 20 < empty < 380  # both found and missing keys


@pytest.mark.parametrize("seed, sep_at_end", STORES)
def test_next_tokens_counts_each_candidate_exactly(seed, sep_at_end):
    """For the run of each key, the candidates with a count are distinct real tokens, each counted as
    often as it follows the key, with the run of key + token as its sub-run; every token that
    follows more than 1/PROBES of the run is among them."""
    tokens, suffixes = random_store(seed, sep_at_end=sep_at_end)
    data = tokens.tolist()
    keys, lengths = random_keys(data, np.random.default_rng(seed + 1), 200, 5, 4)
    runs = [expected_run(data, k[:n]) for k, n in zip(keys.tolist(), lengths.tolist())]
    lo, hi = (jnp.asarray([r[i] for r in runs], jnp.int32) for i in (0, 1))
    token, count, sub_lo, sub_hi = jax.device_get(_next_tokens(jnp.asarray(tokens), jnp.asarray(suffixes), lo, hi,
                                                               jnp.asarray(lengths)))
    for i, (key, n) in enumerate(zip(keys.tolist(), lengths.tolist())):
        key, starts = key[:n], occurrences(data, key[:n])
        counts = next_counts(data, starts, n)
        seen = [int(t) for t, c in zip(token[i], count[i]) if c > 0]
        assert len(seen) == len(set(seen)) and SEP not in seen
        for t, c, a, b in zip(token[i], count[i], sub_lo[i], sub_hi[i]):
            if c > 0:
                assert c == counts[int(t)] and (a, b) == expected_run(data, key + [int(t)]), (key, t)
        assert {t for t, c in counts.items() if c * PROBES > len(starts)} <= set(seen), (key, counts, seen)


@pytest.mark.parametrize("seed, sep_at_end", STORES)
def test_grow_takes_a_most_frequent_next_token_until_none_is_left(seed, sep_at_end):
    """From the run of each key, the continuation of depth 8 is greedy at every depth (ties allowed)
    and stops exactly where no occurrence has a next token (check_greedy_chain)."""
    tokens, suffixes = random_store(seed, sep_at_end=sep_at_end)
    data = tokens.tolist()
    keys, lengths = random_keys(data, np.random.default_rng(seed + 2), 300, 5, 8)
    runs = [expected_run(data, k[:n]) for k, n in zip(keys.tolist(), lengths.tolist())]
    lo, hi = (jnp.asarray([r[i] for r in runs], jnp.int32) for i in (0, 1))
    drafts, present = jax.device_get(_grow(jnp.asarray(tokens), jnp.asarray(suffixes), lo, hi, jnp.asarray(lengths),
                                           8))
    strict = grown = stopped = 0
    for i, (key, n) in enumerate(zip(keys.tolist(), lengths.tolist())):
        s, g = check_greedy_chain(data, occurrences(data, key[:n]), n, drafts[i].tolist(), present[i].tolist())
        strict, grown, stopped = strict + s, grown + g, stopped + (0 < g < 8)
    assert strict > 0.9 * grown and grown > 200 and stopped > 20  # the check had teeth: deep chains, real stops


@pytest.mark.parametrize("min_n, max_n", [(2, 5), (1, 3)])
def test_longest_match_finds_the_longest_suffix_that_occurs(min_n, max_n):
    """Per row, n is the longest n in [min_n, max_n] whose last n context tokens occur in the data
    (occurrences may end at the data's end or before a SEP), with that key's run; n = 0 and an
    empty run where none does. Tokens past the committed length are junk."""
    tokens, suffixes = random_store(11, sep_at_end=False)
    data, rng, width = tokens.tolist(), np.random.default_rng(min_n), 12
    rows = np.asarray(rng.integers(0, 6, (96, width)), np.int32)  # 5: a symbol the data lacks
    length = np.asarray(rng.integers(1, width + 1, 96), np.int32)
    for b in range(0, 96, 3):  # a third: the context ends with a cut of the data (found at length >= n)
        p = int(rng.integers(0, len(data) - length[b]))
        rows[b, : length[b]] = [t if t != SEP else 5 for t in data[p : p + length[b]]]
    rows[1, :3], length[1] = data[-3:], 3  # ends with the data's last tokens
    lo, hi, n = jax.device_get(_longest_match(jnp.asarray(tokens), jnp.asarray(suffixes), jnp.asarray(rows),
                                              jnp.asarray(length), min_n, max_n))
    found = []
    for b in range(96):
        row = rows[b, : length[b]].tolist()
        want = next((m for m in range(min(max_n, len(row)), min_n - 1, -1) if occurrences(data, row[-m:])), 0)
        assert n[b] == want, (row, n[b])
        if want:
            assert (lo[b], hi[b]) == expected_run(data, row[-want:])
        else:
            assert lo[b] == hi[b]
        found.append(want)
    assert found[1] == min(max_n, 3) and 0 in found and max_n in found


# ----------------------------------------------------------------------------
# Proposals on a hand-made datastore

HAND_DOCS = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [8, 9]]  # the last one ends the data (no SEP)


def hand_store() -> Datastore:
    tokens = np.asarray([t for d in HAND_DOCS for t in d + [SEP]][:-1], np.int32)
    return Datastore(tokens, np.asarray(divsufsort(tokens), np.int32), {"sources": ["hand"], "tokenizer": "bytes-258"})


_propose = jax.jit(lambda drafter, params, ctx, gamma: drafter.propose(params, None, ctx, gamma)[0],
                   static_argnums=(0, 3))


def proposal(drafter, rows, gamma):
    """The drafter's proposal (host arrays) for hand-made rows of committed tokens."""
    return jax.device_get(_propose(drafter, drafter.params, context(rows), gamma))


def test_chain_proposals_on_a_hand_made_datastore():
    """The row's own history first (prompt lookup); without a match there, the longest context suffix
    (n >= min_n) that occurs in the datastore, continued by the most frequent next token until a
    document ends (SEP, or the data's end)."""
    rows = [[0, 1, 2, 3],  # [1 2 3] x3 -> 4 (x2) 5, then SEP
            [9, 1, 2],  # [1 2] x3 -> 3 4 5
            [3, 6],  # -> 7, then SEP
            [8, 9],  # at the data's end: nothing follows
            [2],  # one token: shorter than min_n
            [7, 6, 5],  # never in the data
            [1, 2, 9, 1, 2],  # its own [1 2] -> 9 1 2 beats the datastore's 3 4 5
            [7, 7, 7]]  # its own [7 7] -> 7
    drafter = RetrievalDrafter.from_datastore(hand_store())  # lookup: NgramDrafter(max_n=3, min_n=1)
    assert drafter.max_token == 9  # SEP is not a token
    p = proposal(drafter, rows, 4)
    assert [p.drafts[b, :k].tolist() for b, k in enumerate(p.num_draft)] == [
        [4, 5], [3, 4, 5], [7], [], [], [], [9, 1, 2], [7]]
    assert all(H.reference_ngram(row, 4) == [] for row in rows[:6])  # the datastore's rows


def tree_paths(p, b):
    """Row b's root-to-node token paths, checking that parents come first."""
    paths = []
    for c in range(int(p.num_draft[b])):
        parent = int(p.parents[b, c])
        assert parent < c
        paths.append((paths[parent] if parent >= 0 else ()) + (int(p.drafts[b, c]),))
    return paths


def test_tree_proposals_on_a_hand_made_datastore():
    """A tree holds the row's own trie first, then the datastore's K most frequent next tokens (most
    frequent first), each continued greedily to the tree's depth."""
    shape = TreeShape(nodes=8, depth=4, topk=2)
    drafter = RetrievalDrafter.from_datastore(hand_store(), tree=shape)
    assert drafter.lookup.tree == shape  # the lookup drafts the same tree shape
    p = proposal(drafter, [[0, 1, 2, 3], [1, 2], [7, 7], [1, 2, 3, 9, 1, 2, 3]], 8)
    assert tree_paths(p, 0) == [(4,), (4, 5), (6,), (6, 7)]  # 4 follows [1 2 3] twice, 6 once; SEP ends both
    assert p.parents[0, :4].tolist() == [-1, 0, -1, 2]
    assert tree_paths(p, 1) == [(3,), (3, 4), (3, 4, 5)]  # one next token: one branch
    assert tree_paths(p, 2) == [(7,)]  # its own 7 -> 7; nothing in the datastore
    # its own [1 2 3] -> 9 1 2 3 first, then the datastore's [1 2 3] -> 4 5 | 6 7, up to 8 nodes
    assert tree_paths(p, 3) == [(9,), (9, 1), (9, 1, 2), (9, 1, 2, 3), (4,), (4, 5), (6,), (6, 7)]
    assert p.parents[3].tolist() == [-1, 0, 1, 2, -1, 4, -1, 6]


def test_bad_drafter_settings_raise():
    """Context lengths searched in the datastore need 1 <= min_n <= max_n."""
    with pytest.raises(ValueError, match="min_n <= max_n"):
        RetrievalDrafter.from_datastore(hand_store(), min_n=3, max_n=2)
    with pytest.raises(ValueError, match="min_n <= max_n"):
        RetrievalDrafter.from_datastore(hand_store(), min_n=0)


# ----------------------------------------------------------------------------
# The host side: sources, cache, bad input


def python_index(texts: list[str]) -> tuple[list[int], list[int]]:
    """The byte tokenizer's datastore of ``texts``, built in plain Python: each non-empty text's UTF-8
    bytes then SEP, and every suffix start sorted by its suffix."""
    tokens = [t for text in texts if text for t in [*text.encode("utf-8"), SEP]]
    return tokens, sorted(range(len(tokens)), key=lambda i: tokens[i:])


def test_sources_become_tokens_and_a_suffix_array(tmp_path, cache):
    """A JSONL file (every record shape) and a folder (hidden files, __pycache__, binary and
    oversized files skipped; sorted order) give the documents' bytes with SEP after each and the
    suffix array of a plain-Python sort; a token limit keeps whole documents only."""
    records = ["a plain string", {"text": "héllo wörld"}, {"messages": [{"role": "user", "content": "hi"},
                                                                          {"role": "assistant", "content": "ho"}]},
               {"conversations": [{"from": "human", "value": "abab"}]}, {"turns": ["x", "", "yz"]}]
    jsonl = tmp_path / "chats.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records[:3]) + "\n\n" + "\n".join(map(json.dumps, records[3:])))
    folder = tmp_path / "lib"
    (folder / "sub").mkdir(parents=True)
    (folder / "__pycache__").mkdir()
    (folder / "b.py").write_text("def f():\n    return 1\n")
    (folder / "a.md").write_text("# A\n")
    (folder / "sub" / "c.txt").write_text("see a.md")
    (folder / ".hidden").write_text("secret")
    (folder / "__pycache__" / "b.txt").write_text("cached")
    (folder / "blob.bin").write_bytes(b"\xff\xfe\x00\x81")
    (folder / "big.txt").write_text("z" * (ds.MAX_FILE_BYTES + 1))
    texts = ["a plain string", "héllo wörld", "hi", "ho", "abab", "x", "", "yz",
             "# A\n", "def f():\n    return 1\n", "see a.md"]

    store = load_datastore([jsonl, folder], H.target().tokenizer, progress=False)
    tokens, suffixes = python_index(texts)
    assert store.tokens.dtype == np.int32 and store.suffixes.dtype == np.int32
    assert store.tokens.tolist() == tokens and store.suffixes.tolist() == suffixes
    assert store.meta["documents"] == 10 and store.meta["sources"] == [str(jsonl), str(folder)]
    assert store.meta["tokenizer"] == "bytes-258"

    room = len("a plain string") + 1 + len("héllo wörld".encode()) + 1 + 2  # 2 documents and 2 more tokens
    limited = load_datastore(jsonl, H.target().tokenizer, limit=room, progress=False)
    assert limited.tokens.tolist() == python_index(texts[:2])[0] and limited.meta["documents"] == 2


def test_the_index_is_cached_and_rebuilt_when_its_source_changes(tmp_path, cache, capsys):
    """A second load reads the cache silently (a build with progress prints one line); a source whose
    files changed is indexed again."""
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('"one"\n"two"\n')
    first = load_datastore(jsonl, H.target().tokenizer)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("built datastore") and str(cache) in out[0]
    again = load_datastore(jsonl, H.target().tokenizer)
    assert capsys.readouterr().out == ""
    np.testing.assert_array_equal(again.tokens, first.tokens)
    np.testing.assert_array_equal(again.suffixes, first.suffixes)
    jsonl.write_text('"one"\n"two"\n"three"\n')
    changed = load_datastore(jsonl, H.target().tokenizer, progress=False)
    assert changed.tokens.tolist() == python_index(["one", "two", "three"])[0]


def entries(folder: pathlib.Path) -> list[pathlib.Path]:
    """The cache entries in ``folder``: not its lock, holder or partial files (names starting with a dot)."""
    return [p for p in folder.iterdir() if not p.name.startswith(".")]


@pytest.mark.parametrize("keep", [0.5, 0.0])
def test_a_corrupt_cached_index_is_rebuilt_with_one_line(tmp_path, cache, capsys, keep):
    """A truncated tokens.npy (half of it, or all of it) is noticed, reported in one line, and
    built again: the same arrays, cached again."""
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('{"text": "the cat sat on the mat"}\n{"text": "the dog sat"}\n')
    first = load_datastore(jsonl, H.target().tokenizer, progress=False)
    (folder,) = entries(cache / "datastores")
    stored = (folder / "tokens.npy").read_bytes()
    (folder / "tokens.npy").write_bytes(stored[: int(len(stored) * keep)])
    capsys.readouterr()
    rebuilt = load_datastore(jsonl, H.target().tokenizer, progress=False)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "cannot be used" in out[0] and "building it again" in out[0], out
    np.testing.assert_array_equal(rebuilt.tokens, first.tokens)
    np.testing.assert_array_equal(rebuilt.suffixes, first.suffixes)
    assert (folder / "tokens.npy").read_bytes() == stored
    load_datastore(jsonl, H.target().tokenizer, progress=False)
    assert capsys.readouterr().out == ""  # whole again


def test_sharegpt_texts_reads_the_complete_records_of_a_cut_list(tmp_path):
    """A JSON list cut inside its third record gives the turns of the first two (empty turns and
    records without conversations skipped; brackets and commas inside strings are text)."""
    records = [{"id": "a", "conversations": [{"from": "human", "value": "hi, [there]"},
                                             {"from": "gpt", "value": "hello ]"}]},
               {"id": "b", "conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "x,\ny"}]},
               {"id": "empty"},
               {"id": "c", "conversations": [{"from": "human", "value": "cut here please"}]}]
    text = json.dumps(records, indent=1)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.index("cut here") + 3])
    assert sharegpt_texts(path) == ["hi, [there]", "hello ]", "x,\ny"]
    path.write_text(text)  # whole: every record
    assert sharegpt_texts(path) == ["hi, [there]", "hello ]", "x,\ny", "cut here please"]


def bad_sources(tmp_path) -> dict:
    """A bad source of each kind, with the error's words."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("some notes")
    (tmp_path / "blank.jsonl").write_text('\n""\n{"text": ""}\n')
    (tmp_path / "shape.jsonl").write_text('"fine"\n{"prompt": "no text field"}\n')
    (tmp_path / "turns.jsonl").write_text('{"messages": [{"role": "user"}]}\n')
    (tmp_path / "broken.jsonl").write_text('"fine"\n"fine"\n{"text": \n')
    (tmp_path / "latin1.jsonl").write_bytes(b'"ok"\n"\xff"\n')
    return {
        "not-utf8": (tmp_path / "latin1.jsonl", f"{tmp_path / 'latin1.jsonl'}: not UTF-8 text"),
        "missing": (tmp_path / "nowhere", "neither a name (sharegpt) nor an existing file or folder"),
        "empty-folder": (tmp_path / "empty", "holds no text"),
        "no-text": (tmp_path / "blank.jsonl", "holds no text"),
        "txt-file": (tmp_path / "notes.txt", "a file source is JSONL"),
        "wrong-shape": (tmp_path / "shape.jsonl", f"{tmp_path / 'shape.jsonl'}:2: a datastore record is a string or "
                                                  "an object with text, messages"),
        "message-without-content": (tmp_path / "turns.jsonl", f"{tmp_path / 'turns.jsonl'}:1: a datastore record"),
        "not-json": (tmp_path / "broken.jsonl", f"{tmp_path / 'broken.jsonl'}:3: not JSON"),
    }


BAD = ["not-utf8", "missing", "empty-folder", "no-text", "txt-file", "wrong-shape", "message-without-content", "not-json"]


@pytest.mark.parametrize("kind", BAD)
def test_bad_source_is_a_one_line_value_error(tmp_path, cache, kind):
    """load_datastore raises a ValueError naming the problem (and the file:line of a bad record),
    writing no index."""
    source, words = bad_sources(tmp_path)[kind]
    with pytest.raises(ValueError) as err:
        load_datastore(source, H.target().tokenizer, progress=False)
    assert words in str(err.value) and "\n" not in str(err.value)
    assert not (cache / "datastores").exists() or not entries(cache / "datastores")


def test_no_source_or_a_bad_limit_is_refused(tmp_path, cache):
    """No source at all, or a token limit outside [1, 2**30], is a ValueError."""
    with pytest.raises(ValueError, match="needs at least one --datastore"):
        load_datastore([], H.target().tokenizer, progress=False)
    (tmp_path / "a.jsonl").write_text('"text"\n')
    for limit in (0, ds.MAX_TOKENS + 1):
        with pytest.raises(ValueError, match="the datastore limit must be in"):
            load_datastore(tmp_path / "a.jsonl", H.target().tokenizer, limit=limit, progress=False)


@pytest.mark.parametrize("kind", BAD)
def test_bad_source_on_the_command_line_is_one_line_and_exit_2(tmp_path, cache, capsys, kind):
    """`generate --drafter retrieval --datastore BAD` exits 2 with one line on stderr, the error's."""
    source, words = bad_sources(tmp_path)[kind]
    code = main(["generate", "--model", "tiny-random", "--raw", "--drafter", "retrieval", "--datastore", str(source),
                 "--gamma", "4", "--prompt", "hi", "--max-new-tokens", "4"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("specdec-jax: error: ") and words in lines[0], lines


@pytest.mark.parametrize("args, words", [
    (["--drafter", "retrieval"], "the retrieval drafter needs a datastore"),
    (["--drafter", "ngram", "--datastore", "sharegpt"], "datastore is for drafter 'retrieval', not 'ngram'"),
], ids=["retrieval-without-datastore", "datastore-without-retrieval"])
def test_datastore_flag_goes_with_the_retrieval_drafter(capsys, cache, args, words):
    """--drafter retrieval needs --datastore, and --datastore needs --drafter retrieval: one line, exit 2,
    before anything is fetched."""
    code = main(["generate", "--model", "tiny-random", "--raw", "--gamma", "4", "--prompt", "hi", *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("specdec-jax: error: ") and words in lines[0], lines
    assert not (cache / "sharegpt").exists()  # refused before any download


def test_a_datastore_of_another_tokenizer_is_refused():
    """A token id past the target's vocabulary (258 for tiny-random) means another tokenizer built the
    datastore: the engine refuses it before running; ids up to 257 (and SEP) are fine."""
    def store(top):
        tokens = np.asarray([1, 2, 3, SEP, 4, top], np.int32)
        return Datastore(tokens, np.asarray(divsufsort(tokens), np.int32), {"sources": ["x"], "tokenizer": "other"})

    bad = RetrievalDrafter.from_datastore(store(258))
    with pytest.raises(ValueError, match="holds token 258, past the target's 258-token vocabulary: it was built with "
                                         "another tokenizer"):
        generate(H.target(), [[1, 2]], bad, gamma=4, max_new_tokens=4)
    RetrievalDrafter.from_datastore(store(257)).check(H.target().as_target()[0], None)


# ----------------------------------------------------------------------------
# End to end on tiny-random: greedy spec decoding is plain decoding

STORED_ROWS = (0, 1, 3)  # RAGGED rows whose prompt and plain output are documents of the datastore
TREE = TreeShape(nodes=8, depth=4, topk=2)


@functools.cache
def engine_store() -> Datastore:
    """Prompt + plain output of the STORED_ROWS, and a document of random bytes."""
    ref = H.reference()
    noise = np.random.default_rng(3).integers(0, 256, 200).tolist()
    docs = [H.RAGGED[b] + ref.tokens[b] for b in STORED_ROWS] + [noise]
    tokens = np.asarray([t for d in docs for t in d + [SEP]], np.int32)
    return Datastore(tokens, np.asarray(divsufsort(tokens), np.int32), {"sources": ["references"],
                                                                        "tokenizer": "bytes-258"})


DRAFTERS = {"chain": lambda store: RetrievalDrafter.from_datastore(store),
            "datastore-alone": lambda store: RetrievalDrafter.from_datastore(store, lookup=None),
            "tree": lambda store: RetrievalDrafter.from_datastore(store, tree=TREE),
            "tree-datastore-alone": lambda store: RetrievalDrafter.from_datastore(store, tree=TREE, lookup=None)}


@functools.cache
def engine_run(name: str):
    drafter = DRAFTERS[name](engine_store())
    return generate(H.target(), H.RAGGED, drafter, gamma=None if drafter.tree else H.GAMMA, max_new_tokens=H.MAX_NEW,
                    eos_id=H.eos_id())


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_retrieval_equals_plain_decoding(name):
    """Ragged prompts, EOS on: the same tokens and stop reasons as plain decoding, in fewer rounds, with
    drafts accepted; the rows whose continuation the datastore holds take few rounds."""
    ref, out = H.reference(), engine_run(name)
    assert out.tokens == ref.tokens and out.stop_reasons == ref.stop_reasons
    m = out.metrics
    assert m.emitted_tokens == sum(map(len, ref.tokens))
    assert 0 < m.accepted_tokens < m.draft_tokens and m.rounds < ref.metrics.rounds
    for b in STORED_ROWS:  # more than 2 tokens a round
        counts = out.row_counts[b]
        assert counts["accepted_tokens"] > 0 and 2 * counts["rounds"] < counts["emitted_tokens"], (b, counts)
    if name == "tree":  # full-depth trees were verified (and accepted), none deeper
        assert m.position_accepted[TREE.depth - 1] > 0 and not any(m.position_proposed[TREE.depth:])
    else:
        assert m.draft_tokens <= H.GAMMA * m.rounds


def test_the_datastore_is_data_not_part_of_the_program():
    """A datastore of the same size and name but shuffled tokens (its own suffix array) drafts from its
    own arrays: still lossless, and far fewer drafts accepted than from the real one."""
    store = engine_store()
    shuffled = np.random.default_rng(0).permutation(store.tokens).astype(np.int32)
    other = Datastore(shuffled, np.asarray(divsufsort(shuffled), np.int32), store.meta)
    drafter = RetrievalDrafter.from_datastore(other, lookup=None)
    assert drafter == DRAFTERS["datastore-alone"](store)  # the same drafter to the engine; other params
    out = generate(H.target(), H.RAGGED, drafter, gamma=H.GAMMA, max_new_tokens=H.MAX_NEW, eos_id=H.eos_id())
    assert out.tokens == H.reference().tokens
    assert out.metrics.accepted_tokens < engine_run("datastore-alone").metrics.accepted_tokens / 4


@pytest.mark.parametrize("row", [2, 3])
def test_row_of_a_ragged_batch_equals_its_solo_run(row):
    """Greedy, prompt lookup then the datastore: a row run alone gives the same tokens, stop reason,
    rounds, drafts and acceptances as in the ragged batch (row 3's continuation is in the datastore,
    row 2's is not; both in one prompt bucket)."""
    batch = engine_run("chain")
    solo = generate(H.target(), [H.RAGGED[row]], DRAFTERS["chain"](engine_store()), gamma=H.GAMMA,
                    max_new_tokens=H.MAX_NEW, eos_id=H.eos_id(), row_ids=[row])
    assert solo.tokens[0] == batch.tokens[row] and solo.stop_reasons[0] == batch.stop_reasons[row]
    assert solo.row_counts[0] == batch.row_counts[row]


def test_generate_with_a_datastore_folder_on_the_command_line(tmp_path, cache, capsys):
    """`generate --drafter retrieval --datastore FOLDER` exits 0, builds the index once (one line) and
    reuses it on the next call (same output); the prompt's continuation in the folder is drafted."""
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "notes.md").write_text("The quick brown fox jumps over the lazy dog. " * 3)
    (folder / "more.txt").write_text("A quick brown fox, again.")
    args = ["generate", "--model", "tiny-random", "--raw", "--drafter", "retrieval", "--datastore", str(folder),
            "--gamma", "4", "--prompt", "The quick brown", "--max-new-tokens", "16"]
    outputs = []
    for i in range(2):
        assert main([*args, "--json", str(tmp_path / f"{i}.json")]) == 0
        out = capsys.readouterr().out
        built = [line for line in out.splitlines() if line.startswith("built datastore")]
        assert len(built) == (i == 0), out
        outputs.append(json.loads((tmp_path / f"{i}.json").read_text()))
    assert built == [] and "=== prompt-0" in out
    first, second = outputs
    assert first["config"]["drafter"] == "retrieval" and first["config"]["datastore"] == [str(folder)]
    assert first["results"] == second["results"] and 1 <= len(first["results"][0]["tokens"]) <= 16
    assert first["metrics"]["draft_tokens"] > 0  # " fox ..." from the folder (no repeat in the prompt itself)


def test_demo_with_a_datastore_folder_matches_plain_decoding(tmp_path, cache, capsys):
    """`demo --drafter retrieval --datastore FOLDER` runs the drafter beside plain decoding; same output."""
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "notes.md").write_text("The quick brown fox jumps over the lazy dog. " * 3)
    assert main(["demo", "--model", "tiny-random", "--raw", "--drafter", "retrieval", "--datastore", str(folder),
                 "--gamma", "4", "--prompt", "The quick brown", "--max-new-tokens", "12"]) == 0
    row = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("prompt-0 ")]
    assert row and row[-1][-1] == "yes", row  # the summary's "same" column


@pytest.mark.parametrize("name", ["ngram", "chain"])
def test_a_greedy_replay_counts_the_rounds_the_engine_runs(name):
    """`replay.replay_drafter` along the plain greedy outputs gives each row the rounds and emitted
    tokens the engine counts when it runs the drafter (n-gram; prompt lookup then the datastore)."""
    drafter = NgramDrafter(max_n=3, min_n=1) if name == "ngram" else DRAFTERS["chain"](engine_store())
    run = engine_run("chain") if name == "chain" else generate(
        H.target(), H.RAGGED, drafter, gamma=H.GAMMA, max_new_tokens=H.MAX_NEW, eos_id=H.eos_id())
    replayed = replay_drafter(drafter, list(zip(H.RAGGED, H.reference().tokens)), H.GAMMA)
    assert [(r["rounds"], r["emitted_tokens"]) for r in replayed] == [
        (c["rounds"], c["emitted_tokens"]) for c in run.row_counts]


def test_a_replayed_draft_model_extends_the_chain_where_the_output_follows_it():
    """Closed forms: a draft model that is always right accepts gamma a round (ceil(L / (gamma + 1))
    rounds), never right one token a round; after a chain of c right drafts it drafts gamma - c."""
    rows = [([1, 2], list(range(10, 31)))]  # 21 output tokens, nothing to look up
    right, wrong = [[True] * 21], [[False] * 21]
    assert replay_drafter(None, rows, 4, right)[0] == {"rounds": 5, "emitted_tokens": 21, "drafts": 0,
                                                       "model_drafts": 20}
    assert replay_drafter(None, rows, 4, wrong)[0]["rounds"] == 21
    assert replay_greedy(right[0], 4)[0] == 5 and replay_greedy(wrong[0], 4)[0] == 21
    repeat = [([5, 6, 7, 8], [5, 6, 7, 8, 5, 6, 7, 8])]  # 5 | 6 7 8 5 + 6 (prompt lookup) | 7 8
    assert replay_drafter(NgramDrafter(max_n=3, min_n=1), repeat, 4, [[False] * 8])[0]["rounds"] == 3


# ----------------------------------------------------------------------------
# The target's own outputs as a datastore


def test_outputs_store_keeps_the_newest_documents_within_its_capacity():
    """Documents are kept oldest first with a SEP after each, the oldest dropped past the capacity, a
    longer output keeps its last tokens; the arrays keep their shape, SEP-padded, with their suffix array."""
    store = ds.OutputsStore(capacity=12)
    assert store.arrays()[0].tolist() == [SEP] * 12
    store.add([[1, 2, 3], [], [4, 5]])
    store.add([[6, 7, 8, 9]])
    tokens, suffixes = store.arrays()
    assert tokens.tolist() == [1, 2, 3, SEP, 4, 5, SEP, 6, 7, 8, 9, SEP]
    store.add([[10, 11]])  # 15 tokens: the oldest document goes
    tokens, suffixes = store.arrays()
    assert tokens.tolist() == [4, 5, SEP, 6, 7, 8, 9, SEP, 10, 11, SEP, SEP]
    assert suffixes.tolist() == sorted(range(12), key=lambda i: tokens[i:].tolist())
    store.add([list(range(100, 130))])  # longer than the store: its last 11 tokens, alone
    assert store.arrays()[0].tolist() == list(range(119, 130)) + [SEP]
    with pytest.raises(ValueError, match="2 to 2\\*\\*30"):
        ds.OutputsStore(capacity=1)


def outputs_drafter(**options) -> RetrievalDrafter:
    return RetrievalDrafter.from_datastore(None, outputs=4096, **options)


@pytest.mark.parametrize("tree", [None, pytest.param(TREE, marks=pytest.mark.slow)])
def test_outputs_datastore_drafts_from_earlier_calls_never_from_its_own(tree):
    """First call: the store is empty, so every draft is prompt lookup's (the same rounds and drafts as
    the n-gram drafter alone); the same prompts again draft their first call's outputs: the same tokens
    in far fewer rounds. The device arrays keep their shapes as the store fills."""
    drafter = outputs_drafter(tree=tree)
    shapes = jax.tree.map(jnp.shape, drafter.params)
    gamma = None if tree else H.GAMMA
    run = functools.partial(generate, H.target(), H.RAGGED, gamma=gamma, max_new_tokens=H.MAX_NEW, eos_id=H.eos_id())
    lookup_only = run(dataclasses.replace(drafter.lookup))
    first, second = run(drafter), run(drafter)
    assert first.tokens == second.tokens == H.reference().tokens
    assert first.row_counts == lookup_only.row_counts
    assert second.metrics.rounds < first.metrics.rounds / 2 and second.metrics.accepted_tokens > 0
    assert jax.tree.map(jnp.shape, drafter.params) == shapes
    assert drafter.memory.stored == sum(len(t) + 1 for t in first.tokens * 2 if t)


def test_outputs_first_then_the_fixed_datastore():
    """With both datastores, a chain drafts the longest match among them, the outputs one among equals:
    the fixed datastore's continuation until the outputs one holds a longer or equal match."""
    drafter = RetrievalDrafter.from_datastore(hand_store(), outputs=64, lookup=None)
    assert proposal(drafter, [[1, 2, 3]], 2)[0].tolist()[0] == [4, 5]  # the fixed store's most frequent
    drafter.observe([[9, 2, 3, 6, 9]])
    assert proposal(drafter, [[1, 2, 3]], 2)[0].tolist()[0] == [4, 5]  # "1 2 3" is longer than the outputs' "2 3"
    assert proposal(drafter, [[7, 2, 3]], 2)[0].tolist()[0] == [6, 9]  # "2 3" in both: the outputs first


def test_outputs_on_the_command_line_and_refused_by_bench(tmp_path, cache, capsys):
    """`--datastore outputs` alone drafts for later batches from earlier ones; bench refuses it in one line."""
    args = ["--model", "tiny-random", "--raw", "--drafter", "retrieval", "--datastore", "outputs", "--gamma", "4",
            "--prompt", "The quick brown", "--prompt", "The quick brown", "--max-new-tokens", "24"]
    assert main(["generate", *args, "--json", str(tmp_path / "out.json")]) == 0
    first, second = json.loads((tmp_path / "out.json").read_text())["results"]
    assert first["tokens"] == second["tokens"]
    capsys.readouterr()
    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "own earlier output" in err[0], err


# ----------------------------------------------------------------------------
# The sampling law (tests/test_engine_law.py's toy target, prompt, N rows and significance)


@functools.cache
def law_store() -> Datastore:
    """64 documents: the law test's prompt and 4 tokens drawn from the target's own law, so drafts are
    often, not always, right."""
    exact = law.exact_law(law.target(), 4)
    codes = np.random.default_rng(0).choice(exact.size, 64, p=exact)
    docs = [law.PROMPT + [int(c // law.V ** (3 - i) % law.V) for i in range(4)] for c in codes]
    tokens = np.asarray([t for d in docs for t in d + [SEP]], np.int32)
    return Datastore(tokens, np.asarray(divsufsort(tokens), np.int32), {"sources": ["law"], "tokenizer": "toy"})


@pytest.mark.slow
@pytest.mark.parametrize("shape, seed", [(None, 31), (TreeShape(nodes=6, depth=3, topk=2), 32)], ids=["chain", "tree"])
def test_spec_sampling_with_retrieval_follows_the_target_law(shape, seed):
    """Temperature 1, N rows of one prompt, 4 new tokens: the continuations' counts fit the exact law
    (chi-square, significance 1e-4); drafts were both accepted and rejected, at every depth. The
    chain drafts from the datastore alone, the tree from prompt lookup then the datastore."""
    drafter = RetrievalDrafter.from_datastore(law_store(), min_n=1, tree=shape,
                                              **({"lookup": None} if shape is None else {}))
    out = generate(law.target(), [law.PROMPT] * law.N, drafter, gamma=None if shape else 3, sampling=law.SAMPLED,
                   max_new_tokens=4, seed=seed, capacity=16)
    codes = continuation_codes(np.asarray(out.tokens), law.V)
    stat, _, pvalue = chi_square(np.bincount(codes, minlength=law.V**4), law.exact_law(law.target(), 4))
    assert pvalue > law.SIGNIFICANCE, f"chi2 {stat:.1f}, p = {pvalue:.2e}"
    m = out.metrics
    assert m.draft_tokens > law.N and m.accepted_tokens > law.N / 10, m
    assert m.position_proposed[2] > law.N / 10 and m.position_accepted[2] > 0, m
    if shape is None:
        assert 0.1 < m.acceptance_rate < 0.99, m
