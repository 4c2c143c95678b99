"""Settings checked by type, from the dataclass's own annotations: booleans are booleans.

`check_fields(settings)` checks every field of a frozen settings dataclass
(`RunConfig`, `TrainConfig`) against its annotation before any value is used,
so that ``raw: "false"`` in a YAML file is an error naming the key, not a true
value, and ``seed: 1.5`` or ``model: [a]`` is not a traceback later. Accepted
annotations: ``bool``, ``int``, ``float``, ``str``, ``None``, unions of them and
``tuple[X, ...]``. An int is a number (a float field stores it as a float); a
bool is never an int; a list is taken for a tuple. Range checks stay with each
dataclass.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing

NAMES = {bool: "true or false", int: "an int", float: "a number", str: "a string", type(None): "null"}


def _matches(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if origin is tuple:
        return isinstance(value, (tuple, list)) and all(_matches(v, typing.get_args(hint)[0]) for v in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint in (str, type(None)):
        return isinstance(value, hint)
    return True  # Any


def describe(hint) -> str:
    """The annotation in words: ``int | str`` -> "an int or a string"."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(arg) for arg in typing.get_args(hint))
    if origin is tuple:
        return f"a list of {describe(typing.get_args(hint)[0]).split(' ', 1)[-1]}s"
    return NAMES.get(hint, str(hint))


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def check_fields(settings, examples: dict[str, str] | None = None) -> None:
    """ValueError ``"KEY must be TYPE, got VALUE"`` (and ``examples[KEY]``, a valid value, where given) for
    the first field whose value does not match its annotation; converts ints in float fields to floats
    and lists in tuple fields to tuples."""
    hints = _hints(type(settings))
    for field in dataclasses.fields(settings):
        value, hint = getattr(settings, field.name), hints[field.name]
        if not _matches(value, hint):
            example = f" (e.g. {examples[field.name]})" if field.name in (examples or {}) else ""
            raise ValueError(f"{field.name} must be {describe(hint)}{example}, got {value!r}")
        if hint is float:
            try:
                object.__setattr__(settings, field.name, float(value))
            except OverflowError:
                raise ValueError(f"{field.name} must be a number a float can hold, got {value!r}") from None
        elif isinstance(value, list):
            object.__setattr__(settings, field.name, tuple(value))
