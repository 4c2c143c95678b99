"""Grammar constraints on device (`grammar`): masks and states along chains and trees, for rows with
different constraints or none, against the `regex` module's partial matching on the byte tokenizer.

A candidate path's text is a prefix of a match iff its state is not DEAD, and a token is allowed in
a state iff the text extended by it is still such a prefix; the free grammar allows everything.
The distances to a match (`tokens_to_accept`) are those of Bellman-Ford on the dense table."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import regex

from specdec_jax import token_tree
from specdec_jax.constraints import build_tables, token_bytes
from specdec_jax.grammar import DEAD, FAR, FREE, advance, allowed, path_states, stack_grammars, tokens_to_accept
from specdec_jax.models.tokenizer import ByteTokenizer

BYTES = ByteTokenizer()
PATTERNS = ["(yes|no)", "[0-9]{2}-[a-c]+", "a+b*"]
LOGITS = BYTES.vocab_size + 6  # a model's logits may be wider than its tokenizer


@pytest.fixture(scope="module")
def grammar():
    return stack_grammars([build_tables(p, token_bytes(BYTES), BYTES.stop_ids) for p in PATTERNS], LOGITS)


def is_prefix(pattern: str | None, data: bytes) -> bool:
    """The external reference: ``data`` decodes to a prefix of a match of ``pattern`` (None: no constraint)."""
    if pattern is None:
        return True
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return False
    return regex.fullmatch(pattern, text, partial=True) is not None


def random_path(rng, pattern: str | None, length: int) -> list[int]:
    """Bytes that mostly stay inside the language of ``pattern``, now and then any byte."""
    path = []
    for _ in range(length):
        inside = [b for b in b"yesno0123456789-abcx" if is_prefix(pattern, bytes(path + [b]))]
        path.append(int(rng.choice(inside)) if inside and rng.random() < 0.8 else int(rng.integers(0, 256)))
    return path


def test_masks_and_states_of_rows_with_different_constraints_follow_the_regex_module(grammar):
    """Rows with each constraint and one with none, along random byte paths: a state is DEAD iff the text is
    no longer a prefix of a match, the mask allows a byte iff the text extended by it is one, EOS is allowed
    exactly where the text is a whole match, and ids past the tokenizer's vocabulary are never allowed."""
    rng = np.random.default_rng(0)
    kinds = [None, *PATTERNS]
    for _ in range(20):
        paths = [random_path(rng, p, 6) for p in kinds]
        states = grammar.initial[jnp.arange(len(kinds))]
        for step in range(7):
            masks = np.asarray(allowed(grammar, states))  # bool[R, LOGITS]
            for row, pattern in enumerate(kinds):
                text = bytes(paths[row][:step])
                alive = is_prefix(pattern, text)
                assert (int(states[row]) != DEAD) == alive, (pattern, text)
                if not alive or pattern is None:
                    assert masks[row].all()
                    continue
                expected = [is_prefix(pattern, text + bytes([b])) for b in range(256)]
                assert masks[row, :256].tolist() == expected, (pattern, text)
                whole = regex.fullmatch(pattern, text.decode()) is not None
                assert masks[row, BYTES.eos_id] == whole == bool(grammar.accepting[int(states[row])])
                assert not masks[row, BYTES.bos_id] and not masks[row, BYTES.vocab_size :].any()
            if step < 6:
                states = advance(grammar, states, jnp.asarray([p[step] for p in paths]))


def test_eos_keeps_an_accepting_state_and_the_free_grammar_keeps_free(grammar):
    states = grammar.initial
    for token in b"yes":
        states = states.at[1].set(advance(grammar, states[1:2], jnp.asarray([token]))[0])
    after = advance(grammar, states, jnp.full(states.shape, BYTES.eos_id))
    assert int(after[0]) == FREE and int(after[1]) == int(states[1])  # "yes" is a whole match
    assert int(after[2]) == DEAD  # "" is no match of [0-9]{2}-[a-c]+


def test_tree_path_states_follow_each_nodes_own_path(grammar):
    """Random trees of 12 nodes over rows with different constraints: every node's state is the one its own
    path from t0 reaches (walked here token by token along the parents), and a chain is the tree whose
    parents are the nodes before."""
    rng = np.random.default_rng(1)
    rows, nodes = 4, 12
    start = [b"", b"", b"1", b"aa"]  # what t0's path already wrote
    kinds = [0, 1, 2, 3]
    states = grammar.initial[jnp.asarray(kinds)]
    for r, prefix in enumerate(start):
        for token in prefix:
            states = states.at[r].set(advance(grammar, states[r : r + 1], jnp.asarray([token]))[0])
    for _ in range(10):
        parents = np.array([[token_tree.ROOT] + [int(rng.integers(-1, c)) for c in range(1, nodes)] for _ in range(rows)])
        tokens = rng.choice(np.frombuffer(b"yesno12-abcx", np.uint8), size=(rows, nodes)).astype(np.int32)
        got = np.asarray(path_states(grammar, states, jnp.asarray(tokens), jnp.asarray(parents)))
        for r in range(rows):
            pattern = [None, *PATTERNS][kinds[r]]
            for c in range(nodes):
                path, node = [], c
                while node != token_tree.ROOT:
                    path.insert(0, int(tokens[r, node]))
                    node = parents[r, node]
                assert (got[r, c + 1] != DEAD) == is_prefix(pattern, start[r] + bytes(path)), (pattern, path)
        chain = np.asarray(path_states(grammar, states, jnp.asarray(tokens)))
        as_tree = np.asarray(path_states(grammar, states, jnp.asarray(tokens),
                                         jnp.asarray(np.broadcast_to(np.arange(-1, nodes - 1), (rows, nodes)))))
        assert (chain == as_tree).all() and (chain[:, 0] == np.asarray(states)).all()


def test_a_grammar_wider_than_the_logits_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        stack_grammars([build_tables("a", token_bytes(BYTES), BYTES.stop_ids)], 100)


def bellman_ford(next_state: np.ndarray, accepting: np.ndarray) -> np.ndarray:
    """The reference: relax every state over its whole row of the dense table until nothing changes."""
    distance = np.where(accepting, 0, FAR)
    while True:
        via = np.where(next_state >= 0, distance[np.maximum(next_state, 0)] + 1, FAR).min(axis=1, initial=FAR)
        updated = np.minimum(distance, via)
        if (updated == distance).all():
            return distance
        distance = updated


def test_distances_to_a_match_are_bellman_fords():
    """Random tables (cycles, self-loops, states that reach no accepting one, none accepting at all)."""
    rng = np.random.default_rng(7)
    for _ in range(500):
        states, classes = rng.integers(1, 25), rng.integers(1, 6)
        targets = rng.integers(0, states, (states, classes))
        next_state = np.where(rng.random((states, classes)) < rng.random(), targets, -1)
        accepting = rng.random(states) < rng.random() * 0.5
        got = tokens_to_accept(next_state.astype(np.int32), accepting)
        assert got.dtype == np.int32 and np.array_equal(got, bellman_ford(next_state, accepting))
