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
number is one class, every token that cannot occur is one class). The classes come from the
transitions, never the dense table: two tokens share a class iff they have the same (state, next
state) pairs. Two classes are always there:

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

JSON schemas. outlines-core turns a schema into a regex but ignores some keywords without a word;
`json_schema.schema_pattern` enforces or refuses each of them first (docs/constraints.md lists them).

Size. Every step after outlines-core's index is linear in the transitions (numpy over all edges at
once, no per-state scans); the index itself walks every token from every state of the automaton,
holding the interpreter. So a constraint is refused, in one line and before the work, past
`MAX_PATTERN_CHARS` (the automaton), `MAX_INDEX_STEPS` (states x tokens: the index) and
`MAX_TABLE_BYTES` (``next_state``), and a long build shows a progress bar from before the index.

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
from tqdm import tqdm

from specdec_jax import cache
from specdec_jax.cache import cache_dir
from specdec_jax.grammar import FIRST_TEXT_CLASS, NEVER, STOP  # token classes (module docstring)
from specdec_jax.grammar import FAR, edge_distances, ranges, tokens_to_accept
from specdec_jax.json_schema import first_line, schema_pattern
from specdec_jax.models.tokenizer import BPETokenizer, ByteTokenizer

TABLES_FORMAT = "grammar-tables-v1"  # part of the cache key: a change of layout builds again
SHOWN_PATTERN = 80  # characters of a regex quoted in an error line
END, END_PATTERN = "\U0010ffff", r"\x{10FFFF}"  # the end marker after the regex (module docstring)
# Size limits, each refused in one line before the work it bounds (times: a 2-core CPU)
MAX_PATTERN_CHARS = 250_000  # a regex's characters: ~6 s at the limit (an enum of 16,000 strings, bytes)
MAX_INDEX_STEPS = 10**9  # automaton states x tokens: outlines-core's index, ~40 s at the limit
MAX_TABLE_BYTES = 2**28  # next_state i32[S, C]: 256 MiB, on the host and on every device
SHOW_STEPS = 2 * 10**7  # a build of this many index steps (over a second) or more shows a progress bar


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
        """The regex; a schema's is `schema_pattern`'s (ValueError naming what it cannot enforce)."""
        return self.regex if self.regex is not None else schema_pattern(self.json_schema, regex_writes)


def regex_writes(regex: str, raw: bytes) -> bool:
    """Whether some match of ``regex`` holds one of the bytes ``raw`` (its tables over single bytes);
    ValueError (one line) for a regex outlines-core cannot compile."""
    tables = build_tables(regex, [bytes([b]) for b in range(256)] + [b""], (256,), progress=False)
    return bool((tables.next_state[:, tables.token_class[list(raw)]] >= 0).any())


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
    return cache.entry(path, f"the grammar tables of {pattern[:60]!r}", lambda p: _read_tables(p, key, len(vocabulary)),
                       lambda tmp: _write_tables(tmp, key, build_tables(pattern, vocabulary, stop_ids)))


def _write_tables(path, key: str, tables: GrammarTables) -> GrammarTables:
    """``tables`` saved in ``path`` under ``key``."""
    with open(path, "wb") as f:
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
        print(f"the grammar cache {path} is unreadable ({first_line(err, 200)}); building it again", file=sys.stderr)
        return None


def build_tables(pattern: str, vocabulary: list[bytes], stop_ids: tuple[int, ...], progress: bool = True
                 ) -> GrammarTables:
    """The tables of ``pattern`` over tokens with bytes ``vocabulary`` (one entry per id, b"" for
    tokens that are never text) and ``stop_ids`` (the STOP class). ValueError (one line) for a regex
    outlines-core cannot compile, for one that no sequence of these tokens matches, and for one past
    a size limit (`MAX_PATTERN_CHARS`, `MAX_INDEX_STEPS`, `MAX_TABLE_BYTES`), refused before the work it
    bounds. A build of `SHOW_STEPS` or more shows a progress bar (with ``progress``) from before
    outlines-core's index: nothing can update it while that runs."""
    states = _automaton_states(pattern)
    steps = states * len(vocabulary)
    _check_index_steps(states, len(vocabulary))
    with tqdm(total=3, desc=f"grammar tables ({states:,} states x {len(vocabulary):,} tokens)", unit="step",
              disable=not progress or steps < SHOW_STEPS, leave=False) as bar:
        bar.set_postfix_str("outlines-core index")
        end_id = len(vocabulary)
        index = _outlines_index(pattern, vocabulary, stop_ids, end_id)
        bar.update()
        bar.set_postfix_str("transitions")
        ids, source, tokens, target = _token_graph(index, skip={end_id, stop_ids[0]})
        finals = index.get_final_states()
        accepting = np.array([index.get_next_state(int(state), end_id) in finals for state in ids], bool)
        initial = int(np.searchsorted(ids, index.get_initial_state()))
        number = _live_numbering(source, target, accepting, initial)
        if number is None:
            raise ValueError(f"regex {_shown(pattern)}: no sequence of this tokenizer's tokens writes a match")
        bar.update()
        bar.set_postfix_str("token classes")
        keep = (number[source] >= 0) & (number[target] >= 0)  # between the states kept
        source, tokens, target = number[source[keep]], tokens[keep], number[target[keep]]
        token_class = _token_classes(source, tokens, target, len(vocabulary), stop_ids)
        num_states, num_classes = int(number.max()) + 1, int(token_class.max()) + 1
        _check_table_bytes(num_states, num_classes)
        next_state = np.full((num_states, num_classes), -1, np.int32)
        next_state[source, token_class[tokens]] = target
        is_accepting = np.zeros(num_states, bool)
        is_accepting[number[number >= 0]] = accepting[number >= 0]
        next_state[is_accepting, STOP] = np.flatnonzero(is_accepting)
        bar.update()
    return GrammarTables(token_class, next_state, is_accepting, initial=0)


def _check_index_steps(states: int, vocab_size: int) -> None:
    """ValueError (one line) when outlines-core's index would walk more than `MAX_INDEX_STEPS` (state,
    token) pairs: it walks every token's bytes from every state of the automaton, holding the
    interpreter, in time proportional to their product and with no way to stop it."""
    if states * vocab_size > MAX_INDEX_STEPS:
        raise ValueError(f"the constraint's automaton has {states:,} states: indexing them over {vocab_size:,} tokens "
                         f"is {states * vocab_size:.2g} steps, more than the limit {MAX_INDEX_STEPS:.0g}; "
                         f"use a smaller regex, schema or enum")


def _check_table_bytes(num_states: int, num_classes: int) -> None:
    """ValueError (one line) when ``next_state`` (i32[S, C]) would take more than `MAX_TABLE_BYTES`."""
    size = 4 * num_states * num_classes
    if size > MAX_TABLE_BYTES:
        raise ValueError(f"the grammar tables would take {size / 2**20:,.1f} MiB ({num_states:,} states x "
                         f"{num_classes:,} token classes), more than the limit {MAX_TABLE_BYTES / 2**20:,.1f} MiB; "
                         f"use a smaller regex, schema or enum")


def _automaton_states(pattern: str) -> int:
    """The states of ``pattern``'s automaton over bytes (outlines-core's index over the 256 byte tokens),
    the ones its index over a vocabulary visits at most. ValueError (one line) for a regex longer than
    `MAX_PATTERN_CHARS` (checked first: building the automaton takes time in proportion) and for one
    outlines-core does not compile (bad syntax, and what its DFAs lack: lookaround, backreferences,
    start anchors, Unicode word boundaries). 0 when the regex matches nothing (`_outlines_index` says
    why). The regex is compiled alone, so one that is valid only inside END's group, ``a)(b``, is
    refused here."""
    from outlines_core import Index, Vocabulary

    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"the constraint's regex has {len(pattern):,} characters, more than the limit "
                         f"{MAX_PATTERN_CHARS:,}; use a smaller regex, schema or enum")
    try:
        index = Index(pattern, Vocabulary(256, {bytes([b]): [b] for b in range(256)}))
    except ValueError as err:
        if "incompatible with the regex" in str(err):  # the automaton was built: it matches nothing somewhere
            return 0
        raise ValueError(f"regex {_shown(pattern)} is not one outlines-core compiles (bad syntax, lookaround, "
                         f"backreferences, anchors): {first_line(err)}") from None
    seen, stack = set(), [index.get_initial_state()]
    while stack:
        state = stack.pop()
        if state not in seen:
            seen.add(state)
            stack += {index.get_next_state(state, b) for b in index.get_allowed_tokens(state) if b != 256} - seen
    return len(seen)


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
    try:
        return Index(f"(?:{pattern}){END_PATTERN}", Vocabulary(stop_ids[0], ids))
    except ValueError as err:
        missing = re.search(r"following characters: (\[.*?\])", str(err))
        if missing is None:
            raise ValueError(f"regex {_shown(pattern)} is not one outlines-core compiles: {first_line(err)}") from None
        if missing.group(1) == "[]":
            detail = "it matches no text (leave out any end anchor `$`: the whole text is matched anyway)"
        else:
            detail = f"a prefix of a match continues only with one of {missing.group(1)}, which no token writes"
        raise ValueError(f"regex {_shown(pattern)} cannot be written with this tokenizer's tokens: {detail}") from None


def _token_graph(index, skip: set[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """outlines-core's states reachable from its initial state, ``ids`` (i64[S], ascending), and their
    transitions as edges ``source -> target`` (i64[E], indices into ``ids``) by ``tokens`` (i32[E];
    tokens in ``skip`` left out), read one state at a time: its `get_transitions` would hold them all
    as Python ints at once (about 120 bytes each: 1 GB for 9 million)."""
    rows, stack = {}, [index.get_initial_state()]
    while stack:
        state = stack.pop()
        if state in rows:
            continue
        tokens = [t for t in index.get_allowed_tokens(state) if t not in skip]
        targets = [index.get_next_state(state, t) for t in tokens]
        rows[state] = (np.array(tokens, np.int32), np.array(targets, np.int64))
        stack += [t for t in set(targets) if t not in rows]  # not `set - rows.keys()`: that walks every key
    ids = np.array(sorted(rows), np.int64)
    tokens, targets = (np.concatenate([rows[s][k] for s in ids.tolist()]) for k in (0, 1))
    source = np.repeat(np.arange(ids.size), [rows[s][0].size for s in ids.tolist()])
    return ids, source, tokens, np.searchsorted(ids, targets)


def _live_numbering(source: np.ndarray, target: np.ndarray, accepting: np.ndarray, initial: int) -> np.ndarray | None:
    """``i64[S]``: the new number of each state (-1: dropped) given the edges ``source -> target``:
    the states reachable from ``initial`` through states from which an ``accepting`` one is reachable,
    numbered 0.. in breadth-first order (a state's new targets in ascending order of outlines-core's
    ids); None when ``initial`` reaches no accepting state."""
    live = edge_distances(source, target, accepting) < FAR
    if not live[initial]:
        return None
    keep = live[target]
    order = np.lexsort((target[keep], source[keep]))
    source, target = source[keep][order], target[keep][order]
    first = np.searchsorted(source, np.arange(accepting.size + 1))
    number = np.full(accepting.size, -1, np.int64)
    number[initial], frontier, count = 0, np.array([initial]), 1
    while frontier.size:  # one level at a time, in the order of the new numbers
        reached = target[ranges(first[frontier], first[frontier + 1])]
        reached = reached[number[reached] < 0]
        distinct, at = np.unique(reached, return_index=True)
        frontier = distinct[np.argsort(at, kind="stable")]  # first reached, first numbered
        number[frontier] = count + np.arange(frontier.size)
        count += frontier.size
    return number


def _token_classes(source: np.ndarray, tokens: np.ndarray, target: np.ndarray, vocab_size: int,
                   stop_ids: tuple[int, ...]) -> np.ndarray:
    """``i32[V]``: the class of each token (module docstring) given the edges ``source -> target`` by
    ``tokens``: two tokens share a class iff they have the same edges (a token has at most one per
    state, so its edges sorted by source are its column of the dense table); classes numbered in the
    order of their first token; tokens with no edge are NEVER, stop ids STOP."""
    order = np.lexsort((source, tokens))
    column = (source[order] * (int(target.max(initial=0)) + 1) + target[order]).astype(np.int64)
    tokens = tokens[order]
    starts = np.flatnonzero(np.diff(tokens, prepend=-1))
    ends = np.append(starts[1:], tokens.size)
    token_class = np.full(vocab_size, NEVER, np.int32)
    labels: dict[bytes, int] = {}
    for token, start, end in zip(tokens[starts].tolist(), starts.tolist(), ends.tolist()):
        token_class[token] = FIRST_TEXT_CLASS + labels.setdefault(column[start:end].tobytes(), len(labels))
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
