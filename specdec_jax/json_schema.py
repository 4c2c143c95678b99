"""JSON schemas as regexes: what outlines-core enforces, what this module enforces itself, and what is
refused (docs/constraints.md, "JSON schemas").

outlines-core turns a schema into a regex, but reads only some keywords and ignores the rest without a
word (an integer's ``minimum``, ``multipleOf``, a ``type`` beside ``anyOf``, ...). `schema_pattern`
walks the schema as outlines-core does first: it enforces integer bounds itself (`integer_range_regex`),
and refuses in one line every keyword outlines-core would ignore and every schema no value satisfies.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Callable


def first_line(err: Exception, limit: int = 300) -> str:
    """The first line of an error's message (its type's name if it has none), cut at ``limit``."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0].strip()[:limit]



# outlines-core 0.2.14 reads one keyword of a schema object, the first of these it holds, and only
# the keywords that go with it: every other keyword there is ignored
DISPATCH = ("properties", "allOf", "anyOf", "oneOf", "prefixItems", "enum", "const", "$ref", "type")
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "$schema", "$id", "$defs",
                         "definitions", "deprecated", "readOnly", "writeOnly"})  # constrain nothing
TYPE_KEYWORDS = {  # the keywords that constrain values of one JSON type; values of other types pass them
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}),
    "array": frozenset({"items", "prefixItems", "additionalItems", "unevaluatedItems", "minItems", "maxItems",
                        "uniqueItems", "contains", "minContains", "maxContains"}),
    "object": frozenset({"properties", "required", "additionalProperties", "unevaluatedProperties",
                         "patternProperties", "propertyNames", "minProperties", "maxProperties",
                         "dependentRequired", "dependentSchemas", "dependencies"}),
}
HONOURED = {  # the keywords of a type's own that outlines-core enforces (an integer's bounds: `_Schema._integer`)
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "integer": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
    "array": frozenset({"items", "minItems", "maxItems", "uniqueItems"}),
    "object": frozenset({"additionalProperties", "minProperties", "maxProperties", "required"}),
}
MAX_REF_DEPTH = 3  # outlines-core follows $refs nested this deep; one deeper drops the enclosing property
RAW_IN_JSON = bytes([*range(0x20), ord('"'), ord("\\")])  # bytes a JSON string never holds unescaped
NEEDS_JSON_ESCAPE = re.compile(r'["\\\x00-\x1f]')
REGEX_META = re.compile(r'[\\.+*?()|\[\]{}^$#&\-~"\x00-\x1f]')  # in a const's key: written unescaped


class _RefLimit(Exception):
    """outlines-core stops following $refs here (`MAX_REF_DEPTH`): it leaves out the nearest enclosing
    property, and fails when there is none."""


def schema_pattern(text: str, writes: Callable[[str, bytes], bool]) -> str:
    """The regex of the JSON schema ``text``: outlines-core's, for a schema whose every keyword it
    enforces. ``writes(regex, raw)``: whether a match of ``regex`` can hold one of the bytes ``raw``
    (ValueError for a regex that cannot be compiled; `constraints.regex_writes`). Before outlines-core sees it, the schema is walked as outlines-core walks it (`_Schema`):
    a keyword it would ignore is refused in one line (ValueError naming the keyword and where it is),
    as is a schema no value satisfies; an integer's bounds become a placeholder constant, replaced
    in the regex by the bounds' own regex (`integer_range_regex`)."""
    from outlines_core.json_schema import build_regex_from_schema

    schema = json.loads(text)
    walk = _Schema(schema, writes, marker="Zq" + hashlib.sha256(text.encode()).hexdigest()[:20])
    try:
        walk.visit(schema, (), depth=0)
    except _RefLimit:  # no enclosing property: outlines-core refuses the schema itself
        pass
    try:
        pattern = build_regex_from_schema(json.dumps(schema))
    except (ValueError, TypeError) as err:
        raise ValueError(f"outlines-core cannot turn the JSON schema into a regex: {first_line(err)}") from None
    for k, regex in enumerate(walk.ranges):
        pattern = pattern.replace(f'"{walk.marker}n{k}"', f"(?:{regex})")
    return pattern


def _where(path: tuple) -> str:
    """A JSON pointer (RFC 6901) to ``path``, as ``#/properties/age``."""
    return "#" + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def _refuse(path: tuple, message: str):
    raise ValueError(f"JSON schema at {_where(path)}: {message}")


def _json_type(value) -> str:
    """The JSON type of a parsed JSON value (an integral float is an integer, as in JSON Schema)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "integer" if isinstance(value, int) or value.is_integer() else "number"
    return {str: "string", list: "array", dict: "object", type(None): "null"}[type(value)]


def _family(json_type: str) -> str:
    return "number" if json_type == "integer" else json_type


def _passed_by(types: set[str]) -> frozenset:
    """The keywords that only constrain types other than ``types``: values of ``types`` pass them."""
    families = {_family(t) for t in types}
    return frozenset().union(*(words for family, words in TYPE_KEYWORDS.items() if family not in families))


def _count(node: dict, key: str, path: tuple) -> int | None:
    """``node[key]``, a count (minLength, maxItems, ...): a non-negative integer, or None when absent."""
    value = node.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        _refuse(path, f"{key!r} must be a non-negative integer, got {json.dumps(value)}")
    return value


def _counts(node: dict, low: str, high: str, path: tuple) -> tuple[int, int | None]:
    """The bounds ``node[low] .. node[high]`` (0 and None when absent); refused when low > high."""
    least, most = _count(node, low, path) or 0, _count(node, high, path)
    if most is not None and least > most:
        _refuse(path, f"{low} {least} > {high} {most}: no value satisfies both; fix one of them")
    return least, most


@dataclasses.dataclass
class _Schema:
    """One walk over a schema in outlines-core's order (`schema_pattern`): ``visit`` a schema object at
    ``path`` (keys from the root), inside ``depth`` $refs. Rewrites in place: an integer's bounds
    become ``{"const": "<marker>n<k>"}`` with their regex in ``ranges[k]``; a list of types becomes an
    ``anyOf`` of one schema per type (which is what outlines-core writes for it)."""

    root: object
    writes: Callable[[str, bytes], bool]
    marker: str
    ranges: list[str] = dataclasses.field(default_factory=list)

    def visit(self, node, path: tuple, depth: int) -> None:
        if not isinstance(node, dict):
            return  # outlines-core refuses a schema that is not an object
        branch = next((k for k in DISPATCH if k in node), None)
        if branch == "type" and isinstance(node["type"], list):
            self._types(node, path, depth)
        elif branch is not None:
            getattr(self, "_" + branch.lstrip("$"))(node, path, depth)
        # none: {} is any value; anything else outlines-core refuses itself

    def _types(self, node: dict, path: tuple, depth: int) -> None:
        """A list of types: any value of one of them, each with the keywords of its own type (what
        outlines-core writes), rewritten as ``anyOf`` of one schema per type at the same ``path``."""
        if not node["type"]:
            _refuse(path, "an empty 'type' list: no value satisfies it")
        rest = {k: v for k, v in node.items() if k not in ANNOTATIONS and k != "type"}
        for key in rest:
            del node[key]
        node["anyOf"] = [{"type": t, **rest} for t in node.pop("type")]
        for branch in node["anyOf"]:
            self.visit(branch, path, depth)

    def _only(self, node: dict, path: tuple, allowed, beside: str) -> None:
        """Refuses the first keyword of ``node`` outside ``allowed`` and the annotations."""
        for key in node:
            if key not in allowed and key not in ANNOTATIONS:
                hint = " or move it into each branch" if beside in ("beside 'anyOf'", "beside 'oneOf'") else ""
                _refuse(path, f"outlines-core does not enforce {key!r} {beside}; leave it out{hint}")

    def _type_is(self, node: dict, path: tuple, json_type: str, beside: str) -> None:
        """Refuses a ``type`` that excludes ``json_type``, the type of everything outlines-core writes here."""
        types = node.get("type", json_type)
        if json_type not in (types if isinstance(types, list) else [types]):
            _refuse(path, f"'type' {json.dumps(types)} beside {beside!r}: outlines-core writes {json_type} values here")

    def _properties(self, node: dict, path: tuple, depth: int) -> None:
        """An object with these properties in this order, the required ones always, no others."""
        properties, required = node["properties"], node.get("required", [])
        if not isinstance(properties, dict) or not isinstance(required, list):
            return  # outlines-core refuses it
        self._only(node, path, {"properties", "required", "type", "additionalProperties", "unevaluatedProperties",
                                "minProperties", "maxProperties"} | _passed_by({"object"}), "beside 'properties'")
        self._type_is(node, path, "object", "properties")
        for name in properties:
            if NEEDS_JSON_ESCAPE.search(name):
                _refuse(path + ("properties",), f"property name {json.dumps(name)}: outlines-core writes it "
                        f"unescaped, which is not JSON; rename it")
        for name in required:
            if name not in properties:
                _refuse(path, f"'required' names {json.dumps(name)}, which 'properties' does not define: "
                        f"outlines-core would leave it out; define it")
        least, most = _counts(node, "minProperties", "maxProperties", path)
        needed = len(set(required))
        if least > needed:
            _refuse(path, f"outlines-core does not enforce 'minProperties' (it writes as few as the {needed} required "
                    f"properties); make at least {least} of them required")
        if most is not None and len(properties) > most:
            _refuse(path, f"outlines-core does not enforce 'maxProperties' (it may write all {len(properties)} "
                    f"properties); define at most {most}")
        for name, value in properties.items():
            try:
                self.visit(value, path + ("properties", name), depth)
            except _RefLimit:
                if name in required:
                    _refuse(path + ("properties", name), f"$refs nested more than {MAX_REF_DEPTH + 1} deep: "
                            "outlines-core would leave out this required property; make it optional or flatten them")

    def _allOf(self, node: dict, path: tuple, depth: int) -> None:
        branches = node["allOf"]
        if isinstance(branches, list) and len(branches) != 1:
            _refuse(path, f"'allOf' with {len(branches)} schemas: outlines-core writes a value of each, one after "
                    f"the other; merge them into one schema")
        self._branches(node, path, depth, "allOf")

    def _anyOf(self, node: dict, path: tuple, depth: int) -> None:
        self._branches(node, path, depth, "anyOf")

    def _oneOf(self, node: dict, path: tuple, depth: int) -> None:
        branches = node["oneOf"]
        if isinstance(branches, list) and len(branches) > 1:
            _refuse(path, "'oneOf' with several schemas: outlines-core writes it as 'anyOf', so a value may match "
                    "more than one; use 'anyOf' if the branches exclude each other")
        self._branches(node, path, depth, "oneOf")

    def _branches(self, node: dict, path: tuple, depth: int, key: str) -> None:
        branches = node[key]
        if not isinstance(branches, list):
            return  # outlines-core refuses it
        if not branches:
            _refuse(path, f"an empty {key!r}: no value satisfies it")
        self._only(node, path, {key}, f"beside {key!r}")
        for i, branch in enumerate(branches):
            self.visit(branch, path + (key, i), depth)

    def _prefixItems(self, node: dict, path: tuple, depth: int) -> None:
        """An array of exactly these items."""
        items = node["prefixItems"]
        if not isinstance(items, list):
            return  # outlines-core refuses it
        self._only(node, path, {"prefixItems", "type", "items", "additionalItems", "unevaluatedItems", "minItems",
                                "maxItems", "uniqueItems"} | _passed_by({"array"}), "beside 'prefixItems'")
        self._type_is(node, path, "array", "prefixItems")
        least, most = _counts(node, "minItems", "maxItems", path)
        if not least <= len(items) <= (len(items) if most is None else most):
            _refuse(path, f"'prefixItems' writes {len(items)} items, outside 'minItems' .. 'maxItems'; fix the bounds")
        if node.get("uniqueItems") is True and len(items) > 1:
            _refuse(path, "outlines-core does not enforce 'uniqueItems'; leave it out")
        for i, item in enumerate(items):
            self.visit(item, path + ("prefixItems", i), depth)

    def _enum(self, node: dict, path: tuple, depth: int, key: str = "enum") -> None:
        values = node[key] if key == "enum" else [node[key]]
        if not isinstance(values, list):
            return  # outlines-core refuses it
        if not values:
            _refuse(path, "an empty 'enum': no value satisfies it")
        types = {_json_type(v) for v in values}
        self._only(node, path, {key, "type"} | _passed_by(types), f"beside {key!r}")
        if "type" in node:
            allowed = node["type"] if isinstance(node["type"], list) else [node["type"]]
            for value in values:
                if _json_type(value) not in allowed and not (_json_type(value) == "integer" and "number" in allowed):
                    _refuse(path, f"{key!r} value {json.dumps(value)[:60]} is not of 'type' {json.dumps(node['type'])}"
                            ": it could be written but is not valid; fix the type or the values")
        for value in values:
            self._check_keys(value, path)

    def _const(self, node: dict, path: tuple, depth: int) -> None:
        self._enum(node, path, depth, key="const")

    def _check_keys(self, value, path: tuple) -> None:
        """Refuses an object key in a constant that outlines-core writes as a regex, unescaped."""
        if isinstance(value, list):
            for item in value:
                self._check_keys(item, path)
        elif isinstance(value, dict):
            for name, item in value.items():
                if REGEX_META.search(name):
                    _refuse(path, f"the key {json.dumps(name)} of a constant: outlines-core writes keys as "
                            f"unescaped regex, so it cannot hold any of .+*?()|[]{{}}^$#&-~\"\\ or control characters")
                self._check_keys(item, path)

    def _ref(self, node: dict, path: tuple, depth: int) -> None:
        """The schema it points to, resolved as outlines-core does (local refs, keys only)."""
        self._only(node, path, {"$ref"}, "beside '$ref'")
        ref = node["$ref"]
        if not isinstance(ref, str):
            return  # outlines-core refuses it
        if depth > MAX_REF_DEPTH:
            raise _RefLimit
        base, _, fragment = ref.rpartition("#") if "#" in ref else ("", "", ref)
        if base and not (isinstance(self.root, dict) and self.root.get("$id") == base):
            return  # an external ref: outlines-core refuses it
        target, target_path = self.root, ()
        for part in (p for p in fragment.split("/") if p):
            if not isinstance(target, dict) or part not in target:
                return  # outlines-core refuses the path
            target, target_path = target[part], target_path + (part,)
        self.visit(target, target_path, depth + 1)

    def _type(self, node: dict, path: tuple, depth: int) -> None:
        json_type = node["type"]
        if json_type not in ("string", "integer", "number", "boolean", "null", "array", "object"):
            return  # outlines-core refuses it
        on = f"on {'an' if json_type[0] in 'aeiou' else 'a'} {json_type}"
        allowed = {"type"} | _passed_by({json_type})
        allowed |= HONOURED.get(json_type, set())
        self._only(node, path, allowed, on)
        if json_type in ("string", "integer", "array", "object"):
            getattr(self, f"_{json_type}")(node, path, depth)

    def _string(self, node: dict, path: tuple, depth: int) -> None:
        """minLength/maxLength, else pattern, else format: outlines-core reads the first of them only."""
        given = [k for k in ("minLength", "maxLength", "pattern", "format") if k in node]
        if ("minLength" in given or "maxLength" in given) and ({"pattern", "format"} & set(given)):
            _refuse(path, f"outlines-core does not enforce {given[-1]!r} beside a length; leave one of them out")
        if "pattern" in given and "format" in given:
            _refuse(path, "outlines-core does not enforce 'format' beside 'pattern'; leave one of them out")
        _counts(node, "minLength", "maxLength", path)
        if "pattern" in node:
            pattern = node["pattern"]
            if not isinstance(pattern, str):
                _refuse(path, f"'pattern' must be a string, got {json.dumps(pattern)}")
            if pattern.startswith("^") and pattern.endswith("$"):
                pattern = pattern[1:-1]  # outlines-core matches the whole string: it strips these two only
            self._json_safe(pattern, path, "'pattern'")
        elif isinstance(node.get("format"), str):
            from outlines_core.json_schema import build_regex_from_schema

            try:
                quoted = build_regex_from_schema(json.dumps({"type": "string", "format": node["format"]}))
            except ValueError:
                return  # a format outlines-core does not know: it refuses the schema itself
            self._json_safe(quoted[1:-1], path, f"'format' {json.dumps(node['format'])}")

    def _json_safe(self, regex: str, path: tuple, what: str) -> None:
        """Refuses ``what`` when its ``regex`` can write a character a JSON string escapes (outlines-core
        writes the match between quotes as it is)."""
        try:
            unescaped = self.writes(regex, RAW_IN_JSON)
        except ValueError as err:
            _refuse(path, f"{what}: {err}")
        if unescaped:
            _refuse(path, f"{what} can match '\"', '\\' or a control character, which outlines-core would write "
                    f"unescaped (not JSON); exclude them (e.g. [^\"\\\\\\x00-\\x1f] for .)")

    def _integer(self, node: dict, path: tuple, depth: int) -> None:
        """Bounds: the integers in [low, high], by a placeholder (`schema_pattern`)."""
        low, high = None, None
        for key, bound, round_to in (("minimum", 0, math.ceil), ("exclusiveMinimum", 1, math.floor),
                                     ("maximum", 0, math.floor), ("exclusiveMaximum", -1, math.ceil)):
            if key not in node:
                continue
            value = node[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                _refuse(path, f"{key!r} must be a number, got {json.dumps(value)}")
            limit = round_to(value) + bound
            if key.endswith("inimum"):
                low = limit if low is None else max(low, limit)
            else:
                high = limit if high is None else min(high, limit)
        if low is None and high is None:
            return
        if low is not None and high is not None and low > high:
            _refuse(path, f"no integer is >= {low} and <= {high} (minimum/maximum); fix the bounds")
        self.ranges.append(integer_range_regex(low, high))
        for key in [k for k in node if k not in ANNOTATIONS]:
            del node[key]
        node["const"] = f"{self.marker}n{len(self.ranges) - 1}"

    def _array(self, node: dict, path: tuple, depth: int) -> None:
        least, most = _counts(node, "minItems", "maxItems", path)
        if node.get("uniqueItems") is True and (most is None or most > 1):
            _refuse(path, "outlines-core does not enforce 'uniqueItems'; leave it out")
        if isinstance(node.get("items"), dict):
            self.visit(node["items"], path + ("items",), depth)

    def _object(self, node: dict, path: tuple, depth: int) -> None:
        """Any keys, values of ``additionalProperties`` (a schema; absent or true: any value)."""
        if node.get("required"):
            _refuse(path, "'required' without 'properties': outlines-core writes any keys; define the properties")
        least, most = _counts(node, "minProperties", "maxProperties", path)
        if least > 1:
            _refuse(path, "outlines-core does not enforce 'minProperties' above 1 on free-form objects (a key "
                    "may repeat); define the properties instead")
        extra = node.get("additionalProperties", True)
        if extra is False:  # no properties at all: the empty object, which outlines-core writes for maxProperties 0
            if least:
                _refuse(path, "'minProperties' with 'additionalProperties' false and no properties: no object "
                        "satisfies both")
            del node["additionalProperties"]
            node["maxProperties"] = 0
        elif isinstance(extra, dict):
            self.visit(extra, path + ("additionalProperties",), depth)


def integer_range_regex(low: int | None, high: int | None) -> str:
    """A regex of the JSON integers in [``low``, ``high``] (None: unbounded; low <= high), in JSON's
    form: no leading zeros, no ``+``, no ``-0``."""
    parts = []
    if high is None or high >= 0:
        parts.append(_naturals(0 if low is None else max(low, 0), high))
    if low is None or low < 0:
        parts.append("-" + _group(_naturals(1 if high is None or high >= 0 else -high, None if low is None else -low)))
    return "|".join(parts)


def _naturals(low: int, high: int | None) -> str:
    """A regex of the decimals of the integers in [``low``, ``high``] (0 <= low; None: unbounded), one
    alternative per number of digits."""
    digits = len(str(low))
    parts = []
    for n in range(digits, (digits if high is None else len(str(high))) + 1):
        a, b = max(low, 10 ** (n - 1) if n > 1 else 0), 10**n - 1 if high is None else min(high, 10**n - 1)
        if a <= b:
            parts.append(_same_length(str(a), str(b)))
    if high is None:
        parts.append(f"[1-9][0-9]{{{digits},}}")  # every longer number
    return "|".join(parts)


def _same_length(a: str, b: str) -> str:
    """A regex of the decimals from ``a`` to ``b`` (strings of one length, a <= b)."""
    if a == b:
        return a
    if len(a) == 1:
        return f"[{a}-{b}]"
    if a[0] == b[0]:
        return a[0] + _group(_same_length(a[1:], b[1:]))
    rest, low, high, parts, tail = len(a) - 1, int(a[0]), int(b[0]), [], []
    if a[1:] != "0" * rest:  # from a to the end of its first digit
        parts.append(a[0] + _group(_same_length(a[1:], "9" * rest)))
        low += 1
    if b[1:] != "9" * rest:  # from the start of b's first digit to b
        tail.append(b[0] + _group(_same_length("0" * rest, b[1:])))
        high -= 1
    if low <= high:  # every number of the first digits between
        parts.append(f"{low if low == high else f'[{low}-{high}]'}[0-9]{{{rest}}}")
    return "|".join(parts + tail)


def _group(regex: str) -> str:
    return f"(?:{regex})" if "|" in regex else regex
