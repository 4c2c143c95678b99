"""Grammar constraints (a regex or a JSON schema) compiled on the host into small tables a decode loop reads.

outlines-core builds the automaton of a constraint over the tokenizer's vocabulary (an `Index`:
state -> {token id: next state}). `compile_constraint` turns it into numpy arrays:

- ``token_class: i32[V]``: the class of each token id;
- ``next_state: i32[S, C]``: the state after a token of class ``c`` in state ``s``; -1: not allowed;
- ``accepting: bool[S]``: the states where the text so far is a whole match;
- ``initial``: the state before any token (0).

Classes. The dense table would be ``i32[S, V]``; tokens whose columns of it are equal (the same
next state, or -1, in every state) share one class, so a constraint costs
``4 V + 4 S C + S`` bytes instead of ``4 S V``, with C much smaller than V (every digit token of a
number is one class, every token that cannot occur is one class). The classes come from partition
refinement, one state's row at a time, never the dense table. Two classes are always there:

- `NEVER` (0): allowed nowhere: special tokens, and text tokens the constraint never admits;
  ids past V (logits padding) are to be read as this class;
- `STOP` (1): the tokenizer's stop ids: allowed exactly in accepting states, where the state stays.

States are outlines-core's, renumbered 0..S-1 in breadth-first order from the initial state (its
ids are sparse: offsets into its DFA's table). Only states that are reachable and from which some token
sequence reaches an accepting state are kept, with the transitions between them: a state always
allows some token, and a sequence of allowed tokens can always be completed.

END. outlines-core 0.2.14 (its newest release) drops a token after which the text is not a whole
match when the text one byte before its end was one: ``(ab)+`` refuses "a" after "ab", and ``é+``
with byte tokens a second "é". The index is therefore built for the regex followed by END, a
character (U+10FFFF, a noncharacter) no match ends before, written by a token of its own: the
text so far is a match iff that token leads to an accepting state of outlines-core, and END's
transitions are not part of the tables. (Only text that holds U+10FFFF itself can meet the
dropping again: a continuation may then be refused, never a wrong one allowed.)

The decode loop masks a row in state ``s`` with ``next_state[s][token_class] >= 0`` (an i32[V]
gather per position) and moves to ``next_state[s, token_class[t]]`` after token ``t``.

Vocabulary. outlines-core matches token *bytes*: `token_bytes` decodes byte-level BPE tokens
(stored as GPT-2's printable stand-ins, "Ġ" for a space) to the raw bytes the tokenizer's decoder
writes; special tokens and stop ids have no bytes. Only byte-level tokenizers (`ByteTokenizer`, a
`BPETokenizer` whose decoder is ByteLevel) are supported.

Cache. Tables are cached in ``$SPECDEC_CACHE/grammar/<key>.npz``; the key is the sha256 of the
layout version, the outlines-core version, the regex, the stop ids and every token's bytes. An
entry that is unreadable, holds another key or breaks the layout is built again, with one line.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import re
import sys
import zipfile

import numpy as np

from specdec_jax.files import replacing
from specdec_jax.grammar import FIRST_TEXT_CLASS, NEVER, STOP, tokens_to_accept  # token classes (module docstring)
from specdec_jax.models.fetch import cache_dir
from specdec_jax.models.tokenizer import BPETokenizer, ByteTokenizer

TABLES_FORMAT = "grammar-tables-v1"  # part of the cache key: a change of layout builds again
SHOWN_PATTERN = 80  # characters of a regex quoted in an error line
END, END_PATTERN = "\U0010ffff", r"\x{10FFFF}"  # the end marker after the regex (module docstring)


def _first_line(err: Exception, limit: int = 300) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0].strip()[:limit]


def _shown(pattern: str) -> str:
    return repr(pattern if len(pattern) <= SHOWN_PATTERN else pattern[:SHOWN_PATTERN] + "...")


@dataclasses.dataclass(frozen=True)
class Constraint:
    """A regular language the whole generated text must belong to: exactly one of ``regex``
    (outlines-core's syntax, Rust's `regex` crate; matched against the whole text, so without
    anchors; no lookaround or backreferences; ``\\d`` is any Unicode digit) or ``json_schema`` (the
    schema as JSON text). Giving both or neither, or a schema that is not JSON, is a ValueError."""

    regex: str | None = None
    json_schema: str | None = None

    def __post_init__(self):
        if (self.regex is None) == (self.json_schema is None):
            given = "both" if self.regex is not None else "neither"
            raise ValueError(f"a constraint is a regex or a JSON schema, exactly one of them; got {given}")
        if self.json_schema is not None:
            try:
                json.loads(self.json_schema)
            except json.JSONDecodeError as err:
                raise ValueError(f"the JSON schema is not valid JSON: {err}") from None

    def pattern(self) -> str:
        """The regex; a schema's is outlines-core's (ValueError naming what it cannot convert)."""
        if self.regex is not None:
            return self.regex
        from outlines_core.json_schema import build_regex_from_schema

        try:
            return build_regex_from_schema(self.json_schema)
        except (ValueError, TypeError) as err:
            raise ValueError(f"outlines-core cannot turn the JSON schema into a regex: {_first_line(err)}") from None


@dataclasses.dataclass(frozen=True, eq=False)
class GrammarTables:
    """A compiled constraint (module docstring): ``token_class: i32[V]``, ``next_state: i32[S, C]``
    (-1: not allowed), ``accepting: bool[S]``, ``initial`` in [0, S). Checked on construction: a
    table that breaks the layout is a ValueError."""

    token_class: np.ndarray
    next_state: np.ndarray
    accepting: np.ndarray
    initial: int = 0

    def __post_init__(self):
        problem = _layout_problem(self)
        if problem:
            raise ValueError(f"grammar tables break the layout: {problem}")

    @property
    def num_states(self) -> int:
        return self.next_state.shape[0]

    @property
    def num_classes(self) -> int:
        return self.next_state.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the three arrays (``4 V + 4 S C + S``)."""
        return self.token_class.nbytes + self.next_state.nbytes + self.accepting.nbytes

    @functools.cached_property
    def shortest_match(self) -> int:
        """The fewest tokens of a whole match."""
        return int(tokens_to_accept(self.next_state, self.accepting)[self.initial])

    def allowed(self, state: int) -> np.ndarray:
        """``bool[V]``: the tokens allowed in ``state``."""
        return self.next_state[state, self.token_class] >= 0

    def step(self, state: int, token: int) -> int:
        """The state after ``token`` in ``state``; -1 if it is not allowed there."""
        return int(self.next_state[state, self.token_class[token]])


def _layout_problem(t: GrammarTables) -> str | None:
    """What in ``t`` breaks the layout (dtypes, shapes, ranges, the NEVER and STOP columns), or None."""
    if t.token_class.dtype != np.int32 or t.next_state.dtype != np.int32 or t.accepting.dtype != np.bool_:
        return f"dtypes {t.token_class.dtype}, {t.next_state.dtype}, {t.accepting.dtype} (want int32, int32, bool)"
    if t.token_class.ndim != 1 or t.next_state.ndim != 2 or t.accepting.shape != t.next_state.shape[:1]:
        return f"shapes {t.token_class.shape}, {t.next_state.shape}, {t.accepting.shape}"
    (states, classes), stay = t.next_state.shape, np.where(t.accepting, np.arange(t.accepting.size), -1)
    if states == 0 or classes < FIRST_TEXT_CLASS or not 0 <= t.initial < states:
        return f"{states} states, {classes} classes, initial state {t.initial}"
    if t.token_class.min(initial=0) < 0 or t.token_class.max(initial=0) >= classes:
        return f"a token class outside [0, {classes})"
    if t.next_state.min() < -1 or t.next_state.max() >= states:
        return f"a next state outside [-1, {states})"
    if (t.next_state[:, NEVER] != -1).any() or (t.next_state[:, STOP] != stay).any():
        return "the NEVER column allows a token, or the STOP column differs from the accepting states"
    return None


def compile_constraint(constraint: Constraint, tokenizer) -> GrammarTables:
    """The tables of ``constraint`` for ``tokenizer`` (`ByteTokenizer` or byte-level `BPETokenizer`):
    read from the cache, else built (`build_tables`) and cached. ValueError (one line) for a
    schema or regex outlines-core cannot compile and for one this tokenizer's tokens cannot write."""
    pattern = constraint.pattern()
    vocabulary = token_bytes(tokenizer)
    stop_ids = tuple(int(i) for i in tokenizer.stop_ids)
    key = cache_key(pattern, vocabulary, stop_ids)
    path = cache_dir() / "grammar" / f"{key[:24]}.npz"
    tables = _read_tables(path, key, len(vocabulary))
    if tables is None:
        tables = build_tables(pattern, vocabulary, stop_ids)
        with replacing(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, key=np.array(key), token_class=tables.token_class, next_state=tables.next_state,
                     accepting=tables.accepting, initial=np.array(tables.initial))
    return tables


def cache_key(pattern: str, vocabulary: list[bytes], stop_ids: tuple[int, ...]) -> str:
    """sha256 (hex) of the layout version, the outlines-core version, ``pattern``, ``stop_ids`` and
    every token's bytes (length-prefixed, so that no two vocabularies share a key)."""
    head = json.dumps([TABLES_FORMAT, importlib.metadata.version("outlines-core"), pattern, list(stop_ids)])
    digest = hashlib.sha256(head.encode())
    digest.update(b"".join(len(b).to_bytes(4, "little") + b for b in vocabulary))
    return digest.hexdigest()


def _read_tables(path, key: str, vocab_size: int) -> GrammarTables | None:
    """The tables cached in ``path`` under ``key``; None when there are none, and (with one line)
    when the file is unreadable, holds another key or breaks the layout."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as saved:
            if str(saved["key"]) != key:
                raise ValueError("it holds another constraint's key")
            tables = GrammarTables(saved["token_class"], saved["next_state"], saved["accepting"], int(saved["initial"]))
        if tables.token_class.size != vocab_size:
            raise ValueError(f"{tables.token_class.size} token classes for {vocab_size} tokens")
        return tables
    except (OSError, ValueError, TypeError, KeyError, EOFError, zipfile.BadZipFile) as err:
        print(f"the grammar cache {path} is unreadable ({_first_line(err, 200)}); building it again", file=sys.stderr)
        return None


def build_tables(pattern: str, vocabulary: list[bytes], stop_ids: tuple[int, ...]) -> GrammarTables:
    """The tables of ``pattern`` over tokens with bytes ``vocabulary`` (one entry per id, b"" for
    tokens that are never text) and ``stop_ids`` (the STOP class). ValueError (one line) for a regex
    outlines-core cannot compile and for one that no sequence of these tokens matches."""
    end_id = len(vocabulary)
    index = _outlines_index(pattern, vocabulary, stop_ids, end_id)
    graph = _token_graph(index, skip={end_id, stop_ids[0]})
    finals = index.get_final_states()
    accepting = {state for state in graph if index.get_next_state(state, end_id) in finals}
    states, rows = _live_rows(graph, index.get_initial_state(), accepting)
    if not states:
        raise ValueError(f"regex {_shown(pattern)}: no sequence of this tokenizer's tokens writes a match")
    token_class = _token_classes(rows, len(vocabulary), stop_ids)
    next_state = np.full((len(states), int(token_class.max()) + 1), -1, np.int32)
    for state, (tokens, targets) in enumerate(rows):
        next_state[state, token_class[tokens]] = targets
    is_accepting = np.array([s in accepting for s in states])
    next_state[is_accepting, STOP] = np.flatnonzero(is_accepting)
    return GrammarTables(token_class, next_state, is_accepting, initial=0)


def _outlines_index(pattern: str, vocabulary: list[bytes], stop_ids: tuple[int, ...], end_id: int):
    """outlines-core's `Index` of ``pattern`` followed by END (module docstring), over the tokens with
    bytes (stop ids and b"" left out; ``stop_ids[0]`` is its one EOS id) and END as token ``end_id``.
    ValueError (one line) when it cannot build one."""
    from outlines_core import Index, Vocabulary

    ids: dict[bytes, list[int]] = {END.encode(): [end_id]}
    stops = set(stop_ids)
    for token, text in enumerate(vocabulary):
        if text and token not in stops:
            ids.setdefault(text, []).append(token)
    _check_syntax(pattern)
    try:
        return Index(f"(?:{pattern}){END_PATTERN}", Vocabulary(stop_ids[0], ids))
    except ValueError as err:
        missing = re.search(r"following characters: (\[.*?\])", str(err))
        if missing is None:
            raise ValueError(f"regex {_shown(pattern)} is not one outlines-core compiles: {_first_line(err)}") from None
        if missing.group(1) == "[]":
            detail = "it matches no text (leave out any end anchor `$`: the whole text is matched anyway)"
        else:
            detail = f"a prefix of a match continues only with one of {missing.group(1)}, which no token writes"
        raise ValueError(f"regex {_shown(pattern)} cannot be written with this tokenizer's tokens: {detail}") from None


def _check_syntax(pattern: str) -> None:
    """ValueError (one line) unless outlines-core compiles ``pattern`` alone (bad syntax, and what
    its DFAs lack: lookaround, backreferences, start anchors, Unicode word boundaries); a regex
    that is valid only inside END's group, such as ``a)(b``, is refused here."""
    from outlines_core import Index, Vocabulary

    try:
        Index(pattern, Vocabulary(0, {}))
    except ValueError as err:
        if "incompatible with the regex" not in str(err):  # no tokens: the DFA was built
            raise ValueError(f"regex {_shown(pattern)} is not one outlines-core compiles (bad syntax, lookaround, "
                             f"backreferences, anchors): {_first_line(err)}") from None


def _token_graph(index, skip: set[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """outlines-core's states reachable from its initial state, each with its transitions (tokens i32[n],
    next states i64[n]; tokens in ``skip`` left out), read one state at a time: its `get_transitions`
    would hold them all as Python ints at once (about 120 bytes each: 1 GB for 9 million)."""
    graph, stack = {}, [index.get_initial_state()]
    while stack:
        state = stack.pop()
        if state in graph:
            continue
        tokens = [t for t in index.get_allowed_tokens(state) if t not in skip]
        targets = [index.get_next_state(state, t) for t in tokens]
        graph[state] = (np.array(tokens, np.int32), np.array(targets, np.int64))
        stack += set(targets) - graph.keys()
    return graph


def _live_rows(graph: dict[int, tuple[np.ndarray, np.ndarray]], initial: int, accepting: set[int]
               ) -> tuple[list[int], list[tuple[np.ndarray, np.ndarray]]]:
    """The states of ``graph`` (`_token_graph`) from which an ``accepting`` state is reachable, in
    breadth-first order from ``initial`` (their new numbers; none when ``initial`` reaches no accepting
    state), and each one's transitions into such states as (tokens i32[n], next states i32[n] in the
    new numbers)."""
    parents: dict[int, set[int]] = {}
    for state, (_, targets) in graph.items():
        for target in np.unique(targets).tolist():
            parents.setdefault(target, set()).add(state)
    live, stack = set(accepting), list(accepting)
    while stack:
        for parent in parents.get(stack.pop(), ()):
            if parent not in live:
                live.add(parent)
                stack.append(parent)
    if initial not in live:
        return [], []
    states, number, rows = [initial], {initial: 0}, []
    for state in states:  # grows while it is read: a breadth-first walk
        tokens, targets = graph[state]
        keep = np.isin(targets, list(live))
        distinct, inverse = np.unique(targets[keep], return_inverse=True)
        for target in distinct.tolist():
            if target not in number:
                number[target] = len(states)
                states.append(target)
        renumbered = np.array([number[t] for t in distinct.tolist()], np.int32)
        rows.append((tokens[keep], renumbered[inverse.reshape(-1)]))
    return states, rows


def _token_classes(rows: list[tuple[np.ndarray, np.ndarray]], vocab_size: int, stop_ids: tuple[int, ...]) -> np.ndarray:
    """``i32[V]``: the class of each token (module docstring), by partition refinement: after each
    state's row, two tokens share a label iff they agree (next state, or not allowed) on every row
    so far; tokens no row names keep label 0 (NEVER)."""
    label = np.zeros(vocab_size, np.int64)
    count = 1  # labels in use are < count
    for tokens, targets in rows:
        distinct, inverse = np.unique(label[tokens] * len(rows) + targets, return_inverse=True)
        label[tokens] = count + inverse.reshape(-1)
        count += distinct.size
    token_class = np.full(vocab_size, NEVER, np.int32)
    text = label > 0
    token_class[text] = FIRST_TEXT_CLASS + np.unique(label[text], return_inverse=True)[1].reshape(-1)
    token_class[list(stop_ids)] = STOP
    return token_class


def token_bytes(tokenizer) -> list[bytes]:
    """The bytes each token id writes (``list[bytes]`` of length V); b"" for special tokens and stop
    ids. ValueError for a tokenizer that is not byte-level."""
    if isinstance(tokenizer, ByteTokenizer):
        out = [bytes([i]) if i < 256 else b"" for i in range(tokenizer.vocab_size)]
    elif isinstance(tokenizer, BPETokenizer):
        out = _byte_level_bytes(tokenizer.backend, tokenizer.vocab_size)
    else:
        raise ValueError(f"grammar constraints need a ByteTokenizer or a BPETokenizer, got {type(tokenizer).__name__}")
    for i in tokenizer.stop_ids:
        out[i] = b""
    return out


def _byte_level_bytes(tok, vocab_size: int) -> list[bytes]:
    """Bytes of each id of a `tokenizers.Tokenizer` with a ByteLevel decoder, as that decoder writes
    them: a token made of GPT-2 stand-in characters is their bytes, any other token its UTF-8."""
    from tokenizers import decoders

    if not isinstance(tok.decoder, decoders.ByteLevel):
        raise ValueError(f"grammar constraints need a byte-level BPE tokenizer; this one decodes with "
                         f"{type(tok.decoder).__name__}")
    byte_of = _gpt2_byte_of_char()
    stand_ins, to_latin1 = set(byte_of), str.maketrans({c: chr(b) for c, b in byte_of.items()})
    special = {i for i, token in tok.get_added_tokens_decoder().items() if token.special}
    out = []
    for i in range(vocab_size):
        text = tok.id_to_token(i)
        if text is None or i in special:
            out.append(b"")
        elif stand_ins.issuperset(text):
            out.append(text.translate(to_latin1).encode("latin-1"))
        else:
            out.append(text.encode("utf-8"))
    return out


def _gpt2_byte_of_char() -> dict[str, int]:
    """GPT-2's `bytes_to_unicode`, inverted: the byte each of the 256 stand-in characters means
    (printable Latin-1 bytes stand for themselves, the others for chr(256 + n) in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}
