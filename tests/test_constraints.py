"""Grammar constraints compiled to tables (`constraints`), against external references.

- Regexes on the byte tokenizer: along random byte sequences, a sequence is allowed iff its text is a
  prefix of some match and accepting iff it is a match (the `regex` module, partial and whole
  `fullmatch`: `re` knows fewer Unicode digits than Rust's `\\d`); stop ids are allowed exactly in
  accepting states. Walking outlines-core's own `Index` alongside, the tables allow every token it
  allows and more exactly where outlines-core 0.2.14 drops tokens; no two classes have the same
  column; states that cannot reach a match are dropped.
- JSON schemas (person record, tool call, list of strings): random allowed token paths decode to
  JSON that `jsonschema` validates.
- A byte-level BPE tokenizer (built from GGUF metadata): token bytes are what `tokenizers` encodes and
  decodes; special tokens have none; constrained paths decode to matches.
- JSON-schema keywords: integer bounds are enforced (every text the tables allow is in range; the range
  regex against Python on every integer near its bounds); a keyword outlines-core would ignore, and a
  schema no value satisfies, is one ValueError line naming it and where it is (exit 2 from the CLI,
  nothing cached); schemas using every honoured keyword sample to JSON that `jsonschema` validates.
- Size: an enum of 5,000 strings builds in linear time (exactly its 5,000 texts); past a size limit a
  constraint is refused before the work the limit bounds; a long build shows a progress bar.
- Bad input: one ValueError line naming the problem. The disk cache: reused, and rebuilt when corrupt.
- (slow) The SmolLM2 tokenizer: token bytes against its decoder, schema paths against `jsonschema`; CLI
  generations under integer bounds lie in range.
"""

from __future__ import annotations

import codecs
import collections
import functools
import json
import re
import time

import jsonschema
import numpy as np
import pytest
import regex

from specdec_jax import constraints
from specdec_jax.cli import main
from specdec_jax.constraints import (NEVER, STOP, Constraint, GrammarTables, build_tables, cache_key,
                                     compile_constraint, token_bytes)
from specdec_jax.json_schema import integer_range_regex
from specdec_jax.models.tokenizer import CONTROL, USER_DEFINED, BPETokenizer, ByteTokenizer

BYTES = ByteTokenizer()


def byte_tables(pattern: str) -> GrammarTables:
    return build_tables(pattern, token_bytes(BYTES), BYTES.stop_ids)


# ----------------------------------------------------------------------------
# Regexes on the byte tokenizer

REGEXES = ["(yes|no)", "[0-9]{4}-[0-9]{2}-[0-9]{2}", "a+b*c?", "(ab|ac)*d", "é+|[a-c]{2}", r"\d{2}x", "[^a]b", "",
           "(ab)+", "[a-z]+( [a-z]+)*"]
# outlines-core 0.2.14 refuses continuations of these (a token ending one byte after a match, not at one)
INCOMPLETE_IN_OUTLINES_CORE = {"é+|[a-c]{2}", "(ab)+", "[a-z]+( [a-z]+)*"}
ALPHABET = [*"yesnoabcdx0123456789- \n", "é", "è", "€", "٣", "🎉"]  # "٣": a digit to \d, 3 bytes


def check_prefix(tables: GrammarTables, pattern: str, state: int, text: str) -> tuple[bool, bool]:
    """Asserts that ``state`` (-1: a token was refused) is alive iff ``text`` is a prefix of a match and
    accepting iff it is a match, and that the stop id is allowed iff accepting; (alive, accepting)."""
    alive = state >= 0
    assert alive == (regex.fullmatch(pattern, text, partial=True) is not None), (pattern, text)
    if not alive:
        return False, False
    accepting = bool(tables.accepting[state])
    assert accepting == (regex.fullmatch(pattern, text) is not None), (pattern, text)
    mask = tables.allowed(state)
    assert mask[BYTES.eos_id] == accepting and not mask[BYTES.bos_id]
    return True, accepting


@pytest.mark.parametrize("pattern", REGEXES)
def test_byte_tables_allow_exactly_the_prefixes_of_matches(pattern):
    """Random byte walks (each step an allowed byte, or with probability 0.15 a random character of ALPHABET) are
    checked at every character boundary against the `regex` module; an invalid UTF-8 byte is refused."""
    tables = byte_tables(pattern)
    rng = np.random.default_rng(0)
    seen = collections.Counter()
    for _ in range(150):
        state, text, decoder = tables.initial, "", codecs.getincrementaldecoder("utf-8")()
        seen[check_prefix(tables, pattern, state, text)] += 1
        while state >= 0 and len(text) < 16:
            allowed = np.flatnonzero(tables.allowed(state)[:256])
            piece = bytes([rng.choice(allowed)]) if allowed.size and rng.random() < 0.85 else rng.choice(ALPHABET).encode()
            for byte in piece:
                state = tables.step(state, byte) if state >= 0 else -1
                try:
                    text += decoder.decode(bytes([byte]))
                except UnicodeDecodeError:
                    assert state == -1, (pattern, text, piece)
                    break
                if not decoder.getstate()[0]:  # at a character boundary
                    seen[check_prefix(tables, pattern, state, text)] += 1
    assert seen[(False, False)] and seen[(True, True)] and (pattern == "" or seen[(True, False)]), seen


@pytest.mark.parametrize("pattern", REGEXES)
def test_tables_allow_what_outlines_core_allows(pattern):
    """Walking outlines-core's own `Index` of the regex and the tables side by side, every token it allows
    the tables allow, both accept the same texts, and stop ids go exactly with acceptance (outlines-core
    answers None for its EOS). The tables allow more exactly where outlines-core 0.2.14 drops tokens."""
    from outlines_core import Index, Vocabulary

    tables = byte_tables(pattern)
    index = Index(pattern, Vocabulary(BYTES.eos_id, {bytes([b]): [b] for b in range(256)}))
    pairs = [(index.get_initial_state(), tables.initial)]
    seen, only_ours = set(pairs), 0
    for theirs, ours in pairs:
        assert tables.accepting[ours] == index.is_final_state(theirs), (pattern, theirs, ours)
        assert tables.step(ours, BYTES.eos_id) == (ours if tables.accepting[ours] else -1)
        assert tables.step(ours, BYTES.bos_id) == -1
        for token in range(256):
            after, nxt = index.get_next_state(theirs, token), tables.step(ours, token)
            if after is None:
                only_ours += nxt >= 0
            elif (after, nxt) not in seen:
                assert nxt >= 0, (pattern, theirs, token)
                seen.add((after, nxt))
                pairs.append((after, nxt))
    assert (only_ours > 0) == (pattern in INCOMPLETE_IN_OUTLINES_CORE), (
        "outlines-core indexes this regex completely now: the END in constraints.build_tables may go" if not only_ours
        else f"the tables allow {only_ours} tokens outlines-core refuses")


def test_states_that_cannot_reach_a_match_are_dropped():
    """Tokens "aa", "b", "x": "a(aa)*x" needs an odd number of a's, so "aa" never leads to a match and
    only "b" is allowed; without "b" nothing can be written."""
    vocabulary, stop_ids = [b"aa", b"b", b"x", b""], (3,)
    tables = build_tables("a(aa)*x|b", vocabulary, stop_ids)
    assert np.flatnonzero(tables.allowed(0)).tolist() == [1] and tables.num_states == 2
    assert np.flatnonzero(tables.allowed(tables.step(0, 1))).tolist() == [3]
    with pytest.raises(ValueError, match="no sequence of this tokenizer's tokens writes a match"):
        build_tables("a(aa)*x", vocabulary, stop_ids)


@pytest.mark.parametrize("pattern", REGEXES)
def test_classes_are_the_distinct_columns(pattern):
    """Tokens of one class have one column of the dense table (by construction: the table is [S, C]); no
    two text classes (nor a text class and NEVER) have the same column; special ids are NEVER, stop ids
    STOP; every state reaches an accepting state."""
    tables = byte_tables(pattern)
    columns = tables.next_state[:, [NEVER, *range(2, tables.num_classes)]]
    assert np.unique(columns, axis=1).shape[1] == columns.shape[1]
    assert tables.token_class[BYTES.bos_id] == NEVER and tables.token_class[BYTES.eos_id] == STOP
    assert tables.nbytes == 4 * BYTES.vocab_size + 4 * tables.num_states * tables.num_classes + tables.num_states
    live, grew = set(np.flatnonzero(tables.accepting).tolist()), True
    while grew:
        before = len(live)
        live |= {s for s in range(tables.num_states) if set(tables.next_state[s].tolist()) & live}
        grew = len(live) > before
    assert live == set(range(tables.num_states))


# ----------------------------------------------------------------------------
# JSON schemas

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "email": {"type": "string"}},
          "required": ["name", "age"], "additionalProperties": False}
TOOL_CALL = {"type": "object", "required": ["name", "arguments"], "additionalProperties": False, "properties": {
    "name": {"enum": ["get_weather", "search_web", "send_email"]},
    "arguments": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                  "required": ["city", "days"], "additionalProperties": False}}}
ITEMS = {"type": "array", "items": {"type": "string"}, "maxItems": 5}


def sample_path(tables: GrammarTables, rng, limit: int) -> list[int] | None:
    """Token ids of a walk from the initial state, each token uniform over the allowed ones, ended by a
    stop id (not included); None past ``limit`` tokens."""
    state, ids = tables.initial, []
    while len(ids) < limit:
        token = int(rng.choice(np.flatnonzero(tables.allowed(state))))
        if tables.token_class[token] == STOP:
            assert tables.accepting[state]
            return ids
        ids.append(token)
        state = tables.step(state, token)
    return None


def sampled_valid_values(tables, schema, seed: int, tries: int, steps: int, at_least: int) -> list:
    """Values of ``tries`` random paths through ``tables`` (at least ``at_least`` of them end), each
    checked against ``schema`` by `jsonschema`."""
    rng = np.random.default_rng(seed)
    paths = [p for p in (sample_path(tables, rng, steps) for _ in range(tries)) if p is not None]
    assert len(paths) >= at_least
    values = [json.loads(bytes(ids).decode("utf-8")) for ids in paths]
    for value in values:
        jsonschema.validate(value, schema)
    return values


@pytest.mark.parametrize("schema", [PERSON, TOOL_CALL, ITEMS], ids=["person", "tool_call", "items"])
def test_schema_paths_are_valid_json_of_the_schema(schema):
    values = sampled_valid_values(byte_tables(Constraint(json_schema=json.dumps(schema)).pattern()), schema,
                                  seed=1, tries=40, steps=4000, at_least=30)
    if schema is PERSON:
        assert {"email" in value for value in values} == {True, False}  # the optional field, with and without


# ----------------------------------------------------------------------------
# JSON-schema keywords: enforced or refused


def schema_tables(schema) -> GrammarTables:
    return byte_tables(Constraint(json_schema=json.dumps(schema)).pattern())


def all_texts(tables: GrammarTables, limit: int = 100_000) -> set[str]:
    """Every text the tables accept (a finite language), walking the byte tokens depth first."""
    out, stack = set(), [(tables.initial, b"")]
    while stack:
        state, text = stack.pop()
        if tables.accepting[state]:
            out.add(text.decode("utf-8"))
        allowed = np.flatnonzero(tables.allowed(state)[:256])
        stack += [(tables.step(state, b), text + bytes([b])) for b in allowed.tolist()]
        assert len(out) + len(stack) < limit, "not a finite language"
    return out


SMALL_BOUNDS = [None, *range(-25, 26)]
EDGE_BOUNDS = [None, -1001, -1000, -999, -200, -101, -100, -99, -11, -10, -9, -1, 0, 1, 9, 10, 11, 99, 100, 101,
               199, 909, 999, 1000, 1001]


@pytest.mark.parametrize("bounds, window", [(SMALL_BOUNDS, 40), (EDGE_BOUNDS, 1100)], ids=["small", "edges"])
def test_integer_range_regex_matches_exactly_the_integers_in_range(bounds, window):
    """Against Python on every integer in [-window, window] and on forms JSON does not write (leading zeros,
    "+", "-0"), for every pair of bounds (None: unbounded) with low <= high."""
    others = ["", "-", "+1", "-0", "00", "01", "-01", "007", "1.0", "1e3", " 1"]
    for low in bounds:
        for high in bounds:
            if low is not None and high is not None and low > high:
                continue
            compiled = re.compile(integer_range_regex(low, high))
            for i in range(-window, window + 1):
                inside = (low is None or low <= i) and (high is None or i <= high)
                assert bool(compiled.fullmatch(str(i))) == inside, (low, high, i)
            assert not any(compiled.fullmatch(text) for text in others), (low, high)


@pytest.mark.parametrize("schema, values", [
    ({"type": "integer", "minimum": 10, "maximum": 99}, range(10, 100)),
    ({"type": "integer", "exclusiveMinimum": -3.5, "maximum": 2.5}, range(-3, 3)),
    ({"type": "integer", "minimum": 5, "exclusiveMaximum": 7, "format": "int32", "title": "t"}, range(5, 7)),
    ({"type": ["integer", "null"], "minimum": 0, "maximum": 3}, [0, 1, 2, 3, None]),
    ({"$ref": "#/$defs/small", "$defs": {"small": {"type": "integer", "minimum": -2, "maximum": 2}}}, range(-2, 3)),
])
def test_integer_bounds_are_enforced(schema, values):
    """outlines-core ignores minimum/maximum; the tables allow exactly the texts of the integers in range."""
    assert all_texts(schema_tables(schema)) == {json.dumps(v) for v in values}


def test_an_unbounded_side_stays_unbounded():
    tables = schema_tables({"type": "integer", "minimum": -1000})
    texts = {"-1000", "-999", "0", "7", "123456789012345678901234567890"}
    for text in [*texts, "-1001", "-10000", "-0"]:
        state = tables.initial
        for byte in text.encode():
            state = tables.step(state, byte) if state >= 0 else -1
        assert (state >= 0 and bool(tables.accepting[state])) == (text in texts), text


HONOURED = {  # every keyword outlines-core enforces, and some that no value of the type written can fail
    "type": "object", "title": "record", "additionalProperties": False, "required": ["id", "name", "pair"],
    "$defs": {"score": {"type": "integer", "exclusiveMinimum": 0, "maximum": 10, "description": "1..10"}},
    "properties": {
        "id": {"type": "integer", "minimum": 100, "maximum": 250},
        "name": {"type": "string", "minLength": 1, "maxLength": 6, "minimum": 3},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{1,3}$"},
        "day": {"type": "string", "format": "date-time"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"], "type": "string"}, "minItems": 1, "maxItems": 3},
        "pair": {"type": "array", "prefixItems": [{"$ref": "#/$defs/score"}, {"type": "boolean"}], "minItems": 2,
                 "items": False},
        "maybe": {"type": ["integer", "null"], "minimum": -5, "maximum": -1},
        "either": {"anyOf": [{"const": {"k": [1, "x"]}}, {"type": "object", "additionalProperties": {"type": "integer",
                                                                                                   "maximum": 0}}]},
        "one": {"oneOf": [{"type": "null"}]},
        "all": {"allOf": [{"type": "integer", "minimum": 7, "maximum": 9}]},
    },
}


def test_schemas_with_every_honoured_keyword_sample_valid_json():
    values = sampled_valid_values(schema_tables(HONOURED), HONOURED, seed=4, tries=60, steps=3000, at_least=40)
    assert {"maybe" in v for v in values} == {True, False} and {v["id"] for v in values} <= set(range(100, 251))


@pytest.mark.parametrize("schema, message", [
    ({"type": "integer", "minimum": 10, "maximum": 5}, "at #: no integer is >= 10 and <= 5"),
    ({"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 6}, "no integer is >= 6 and <= 5"),
    ({"type": "integer", "minimum": "3"}, "'minimum' must be a number, got \"3\""),
    ({"type": "integer", "maximum": True}, "'maximum' must be a number, got true"),
    ({"type": "integer", "multipleOf": 3}, "does not enforce 'multipleOf' on an integer; leave it out"),
    ({"type": "integer", "minimum": 1, "foo": 1}, "does not enforce 'foo' on an integer"),
    ({"type": "number", "minimum": 0}, "does not enforce 'minimum' on a number"),
    ({"type": "number", "exclusiveMaximum": 1.5}, "does not enforce 'exclusiveMaximum' on a number"),
    ({"type": "string", "minLength": 5, "maxLength": 4}, "minLength 5 > maxLength 4: no value satisfies both"),
    ({"type": "string", "maxLength": 1.5}, "'maxLength' must be a non-negative integer, got 1.5"),
    ({"type": "string", "minLength": -1}, "'minLength' must be a non-negative integer, got -1"),
    ({"type": "string", "maxLength": 3, "pattern": "a+"}, "does not enforce 'pattern' beside a length"),
    ({"type": "string", "pattern": "a", "format": "date"}, "does not enforce 'format' beside 'pattern'"),
    ({"type": "string", "pattern": ".+"}, "'pattern' can match '\"', '\\' or a control character"),
    ({"type": "string", "pattern": "(ab"}, "'pattern': regex '(ab' is not one outlines-core compiles"),
    ({"type": "string", "format": "email"}, "'format' \"email\" can match '\"'"),
    ({"type": "string", "format": "ipv4"}, "Format ipv4 is not supported"),
    ({"type": "string", "contentEncoding": "base64"}, "does not enforce 'contentEncoding' on a string"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "minItems 3 > maxItems 2"),
    ({"type": "array", "uniqueItems": True}, "does not enforce 'uniqueItems'"),
    ({"type": "array", "contains": {"type": "integer"}}, "does not enforce 'contains' on an array"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 2}, "'prefixItems' writes 1 items"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "'required' names \"b\", which 'properties'"),
    ({"type": "object", "properties": {"a": {}}, "minProperties": 1}, "does not enforce 'minProperties'"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "maxProperties": 1}, "does not enforce 'maxProperties'"),
    ({"type": "object", "properties": {}, "patternProperties": {"a": {}}}, "'patternProperties' beside 'properties'"),
    ({"type": "string", "properties": {}}, "'type' \"string\" beside 'properties'"),
    ({"type": "object", "properties": {"a\"b": {}}}, "at #/properties: property name \"a\\\"b\""),
    ({"type": "object", "required": ["a"]}, "'required' without 'properties'"),
    ({"type": "object", "minProperties": 2}, "'minProperties' above 1"),
    ({"type": "object", "additionalProperties": False, "minProperties": 1}, "no object satisfies both"),
    ({"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}, "at #/properties/n: $refs nested"),
    ({"enum": []}, "an empty 'enum': no value satisfies it"),
    ({"anyOf": []}, "an empty 'anyOf'"),
    ({"type": []}, "an empty 'type' list"),
    ({"type": ["null", "integer"], "minimum": 3, "maximum": 2}, "at #: no integer is >= 3 and <= 2"),
    ({"enum": ["a", 1], "type": "string"}, "'enum' value 1 is not of 'type' \"string\""),
    ({"enum": ["a"], "maxLength": 0}, "does not enforce 'maxLength' beside 'enum'"),
    ({"const": 3, "minimum": 4}, "does not enforce 'minimum' beside 'const'"),
    ({"const": {"a.b": 1}}, "the key \"a.b\" of a constant"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "'oneOf' with several schemas"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "'allOf' with 2 schemas"),
    ({"anyOf": [{"type": "integer"}], "type": "integer"}, "'type' beside 'anyOf'; leave it out or move it into"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"type": "integer"}}, "maximum": 3}, "'maximum' beside '$ref'"),
    ({"type": "object", "properties": {"age": {"type": "integer", "multipleOf": 2}}}, "at #/properties/age: "),
    ({"type": "array", "items": {"anyOf": [{"type": "string", "maxLength": 1, "minLength": 2}]}},
     "at #/items/anyOf/0: minLength 2 > maxLength 1"),
])
def test_keywords_outlines_core_ignores_and_unsatisfiable_schemas_are_one_line(schema, message):
    with pytest.raises(ValueError) as err:
        Constraint(json_schema=json.dumps(schema)).pattern()
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("schema, message", [
    ({"type": "integer", "minimum": 10, "maximum": 5}, "schema.json: JSON schema at #: no integer is >= 10 and <= 5"),
    ({"properties": {"n": {"type": "number", "maximum": 1}}}, "at #/properties/n: outlines-core does not enforce "
                                                            "'maximum' on a number"),
])
def test_the_cli_refuses_a_schema_in_one_line_and_caches_nothing(tmp_path, monkeypatch, capsys, schema, message):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    assert main(["generate", "--model", "tiny-random", "--raw", "--prompt", "hi", "--json-schema", str(path)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and not captured.out, err
    assert not list((tmp_path / "cache").glob("grammar/*"))


@pytest.mark.slow
def test_generated_integers_lie_in_range(tmp_path, capsys):
    """Sampled generations from the CLI under {"type": "integer", "minimum": 10, "maximum": 99} (slow: a
    compile for these tables' shapes; `test_integer_bounds_are_enforced` checks every text they allow)."""
    schema = {"type": "integer", "minimum": 10, "maximum": 99}
    path, out = tmp_path / "schema.json", tmp_path / "out.json"
    path.write_text(json.dumps(schema))
    prompts = [arg for text in ("hi", "a number", "7", "-3") for arg in ("--prompt", text)]
    assert main(["generate", "--model", "tiny-random", "--raw", "--max-new-tokens", "6", "--temperature", "1",
                 *prompts, "--json-schema", str(path), "--json", str(out)]) == 0
    capsys.readouterr()
    for result in json.loads(out.read_text())["results"]:
        jsonschema.validate(json.loads(result["text"]), schema)


# ----------------------------------------------------------------------------
# Size: long enums, limits, progress


def varied_strings(n: int) -> list[str]:
    """``n`` distinct strings of 5 to 20 letters and spaces (a seeded generator)."""
    rng, out = np.random.default_rng(5), set()
    while len(out) < n:
        out.add("".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz "), rng.integers(5, 21))))
    return sorted(out)


@pytest.mark.parametrize("values", [[f"value{i:04d}" for i in range(1, 5001)], varied_strings(5000)],
                         ids=["numbered", "varied"])
def test_an_enum_of_5000_strings_builds_in_linear_time(values):
    """52,087 states for the varied strings; the walk that was quadratic in the states took over 20
    minutes for them (and 7 s for the numbered ones, 5,566 states); about 1.5 s now on a 2-core CPU."""
    start = time.perf_counter()
    tables = schema_tables({"enum": values})
    assert time.perf_counter() - start < 30
    text_tokens = np.bincount(tables.token_class[:256], minlength=tables.num_classes)

    @functools.lru_cache(maxsize=None)
    def texts_from(state: int) -> int:
        row = tables.next_state[state]
        return int(tables.accepting[state]) + sum(int(text_tokens[c]) * texts_from(int(row[c]))
                                                  for c in np.flatnonzero(row >= 0).tolist() if c != STOP)

    assert texts_from(tables.initial) == len(values)
    rng = np.random.default_rng(6)
    for _ in range(20):
        assert json.loads(bytes(sample_path(tables, rng, 100)).decode()) in values


@pytest.mark.parametrize("limit, value, message", [
    ("MAX_PATTERN_CHARS", 10, "the constraint's regex has 24 characters, more than the limit 10"),
    ("MAX_INDEX_STEPS", 1000, "the constraint's automaton has 11 states: indexing them over 258 tokens is 2.8e+03 "
                              "steps, more than the limit 1e+03"),
])
def test_a_constraint_past_a_size_limit_is_refused_before_the_work(monkeypatch, limit, value, message):
    """Refused before outlines-core's index of the vocabulary (the work the limits bound) is built."""
    monkeypatch.setattr(constraints, limit, value)
    monkeypatch.setattr(constraints, "_outlines_index", lambda *args: pytest.fail("indexed"))
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        byte_tables("(yes|no|maybe)[0-9]{1,2}")
    assert "\n" not in str(err.value)


def test_tables_past_the_byte_limit_are_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(constraints, "MAX_TABLE_BYTES", 100)
    with pytest.raises(ValueError, match=r"the grammar tables would take 0.0 MiB \(9 states x 10 token classes\), "
                                         r"more than the limit 0.0 MiB"):
        compile_constraint(Constraint(regex="(yes|no|maybe)"), BYTES)
    assert not list(tmp_path.glob("grammar/*.npz"))


def test_a_long_build_shows_a_progress_bar(monkeypatch, capsys):
    byte_tables("(yes|no)")
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(constraints, "SHOW_STEPS", 0)
    byte_tables("(yes|no)")
    assert "grammar tables (5 states x 258 tokens)" in capsys.readouterr().err


# ----------------------------------------------------------------------------
# A byte-level BPE tokenizer


def tiny_bpe() -> BPETokenizer:
    """A GGUF-style byte-level BPE: the 256 byte tokens (GPT-2 stand-ins, as `tokenizers` lists them),
    a few merges, two control tokens (BOS, and EOS: the stop id) and a plain added token."""
    from tokenizers import pre_tokenizers

    merged = ["Ġa", "ab", "Ġab", "Ãł"]
    tokens = ["<|endoftext|>", "<|im_end|>", *sorted(pre_tokenizers.ByteLevel.alphabet()), *merged, "<tool_call>"]
    types = [CONTROL, CONTROL, *[1] * (256 + len(merged)), USER_DEFINED]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": ["Ġ a", "a b", "Ġa b", "Ã ł"],
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1}
    return BPETokenizer.from_gguf_metadata(meta)


def test_bpe_token_bytes_are_what_the_tokenizer_encodes_and_decodes():
    tok = tiny_bpe()
    vocabulary = token_bytes(tok)
    assert vocabulary[0] == vocabulary[1] == b"" and vocabulary[-1] == b"<tool_call>"
    assert sorted(vocabulary[2:258]) == [bytes([b]) for b in range(256)]
    text = " ab ab<tool_call>à" + "".join(chr(c) for c in range(0x20, 0x3000, 5)) + "🎉\n\t"
    ids = tok.encode(text)
    assert {tok.encode(" ab")[0], tok.encode("<tool_call>")[0]} <= set(ids)  # merged and added tokens occur
    assert b"".join(vocabulary[i] for i in ids) == text.encode("utf-8")
    for i, data in enumerate(vocabulary):
        if data:
            try:
                assert tok.decode([i]) == data.decode("utf-8")
            except UnicodeDecodeError:  # a lone byte of a longer character
                assert len(data) == 1 and data[0] >= 0x80


def test_bpe_paths_decode_to_matches():
    tok = tiny_bpe()
    pattern = "( ab|à)+(<tool_call>)?"
    tables = build_tables(pattern, token_bytes(tok), tok.stop_ids)
    assert tables.allowed(0)[tok.encode(" ab")[0]] and not tables.allowed(0)[tok.encode("<tool_call>")[0]]
    rng = np.random.default_rng(2)
    for _ in range(30):
        ids = sample_path(tables, rng, 200)
        assert re.fullmatch(pattern, tok.decode(ids)), tok.decode(ids)


def test_a_tokenizer_that_is_not_byte_level_is_refused():
    from tokenizers import Tokenizer, decoders, models

    inner = Tokenizer(models.BPE({"▁a": 0, "</s>": 1}, []))
    inner.decoder = decoders.Metaspace()
    with pytest.raises(ValueError, match="byte-level BPE tokenizer; this one decodes with Metaspace"):
        token_bytes(BPETokenizer(inner, bos_id=None, stop_ids=(1,), chat_template=None))
    with pytest.raises(ValueError, match="need a ByteTokenizer or a BPETokenizer, got str"):
        token_bytes("bytes")


# ----------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("make, message", [
    (lambda: Constraint(), "exactly one of them; got neither"),
    (lambda: Constraint(regex="a", json_schema="{}"), "exactly one of them; got both"),
    (lambda: Constraint(json_schema="{not json"), "the JSON schema is not valid JSON: Expecting property name"),
    (lambda: Constraint(json_schema='{"not": {"type": "string"}}').pattern(),
     'cannot turn the JSON schema into a regex: Unsupported JSON Schema structure {"not"'),
    (lambda: Constraint(json_schema='{"type": "tuple"}').pattern(), "Unsupported type: tuple"),
    (lambda: byte_tables("(ab"), r"regex '\(ab' is not one outlines-core compiles \(bad syntax"),
    (lambda: byte_tables("a)(b"), r"regex 'a\)\(b' is not one outlines-core compiles"),
    (lambda: byte_tables("a(?=b)"), "lookaround, backreferences"),
    (lambda: byte_tables("^a"), "anchors.*start state"),
    (lambda: byte_tables(r"a\b"), "Unicode word boundaries"),
    (lambda: byte_tables(r"a[^\x00-\x{10FFFF}]"), "cannot be written with this tokenizer's tokens: it matches no text"),
    (lambda: byte_tables("a$"), "leave out any end anchor"),
    (lambda: build_tables("xy|b", [b"x", b"b", b""], (2,)), r"continues only with one of \[\"y\"\], which no token"),
])
def test_bad_input_is_one_value_error_line(make, message):
    with pytest.raises(ValueError, match=message) as err:
        make()
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------
# The disk cache


def same(a: GrammarTables, b: GrammarTables) -> bool:
    return (a.initial == b.initial and np.array_equal(a.token_class, b.token_class)
            and np.array_equal(a.next_state, b.next_state) and np.array_equal(a.accepting, b.accepting))


def test_cache_key_names_pattern_stop_ids_and_every_token():
    vocabulary = token_bytes(BYTES)
    key = cache_key("a", vocabulary, (257,))
    assert len({key, cache_key("b", vocabulary, (257,)), cache_key("a", vocabulary, (256, 257)),
                cache_key("a", [*vocabulary[:-2], b"", b"\xff"], (257,)),
                cache_key("a", [b"a" + vocabulary[1], *vocabulary[2:]], (257,))}) == 5


def test_cache_is_reused_and_a_corrupt_file_rebuilt(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    constraint = Constraint(json_schema=json.dumps(PERSON))
    first = compile_constraint(constraint, BYTES)
    [path] = (tmp_path / "grammar").glob("*.npz")
    real, built = constraints.build_tables, []

    def refuse(*args):
        raise AssertionError("built again")

    monkeypatch.setattr(constraints, "build_tables", refuse)
    assert same(compile_constraint(constraint, BYTES), first)
    with pytest.raises(AssertionError, match="built again"):  # another constraint, another entry
        compile_constraint(Constraint(regex="(yes|no)"), BYTES)
    monkeypatch.setattr(constraints, "build_tables", lambda *args: built.append(1) or real(*args))
    good = path.read_bytes()
    broken_layout = tmp_path / "broken.npz"
    with np.load(path) as saved:
        np.savez(broken_layout, **{**saved, "next_state": saved["next_state"] + 1})
    other_key = tmp_path / "other.npz"
    with np.load(path) as saved:
        np.savez(other_key, **{**saved, "key": np.array("0" * 64)})
    for corrupt in (b"not a zip file", good[: len(good) // 2], broken_layout.read_bytes(), other_key.read_bytes()):
        path.write_bytes(corrupt)
        assert same(compile_constraint(constraint, BYTES), first)
        assert "is unreadable" in capsys.readouterr().err
        with np.load(path) as saved:  # written again, whole
            assert str(saved["key"]) == cache_key(constraint.pattern(), token_bytes(BYTES), BYTES.stop_ids)
    assert len(built) == 4


# ----------------------------------------------------------------------------
# A real tokenizer


@pytest.mark.slow
def test_smollm2_token_bytes_and_schema_paths():
    from specdec_jax.models import load_model

    tok = load_model("smollm2-135m").tokenizer
    vocabulary = token_bytes(tok)
    assert len(vocabulary) == tok.vocab_size == 49152
    for i, data in enumerate(vocabulary):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        assert tok.decode([i]) == text, i
    for schema in (PERSON, TOOL_CALL):
        tables = build_tables(Constraint(json_schema=json.dumps(schema)).pattern(), vocabulary, tok.stop_ids)
        rng = np.random.default_rng(3)
        paths = [p for p in (sample_path(tables, rng, 3000) for _ in range(20)) if p is not None]
        assert len(paths) >= 10
        for ids in paths:
            jsonschema.validate(json.loads(tok.decode(ids)), schema)
