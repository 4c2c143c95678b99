"""Settings checked by type, from the dataclass's own annotations: booleans are booleans.

`coerce(value, hint, key)` checks one setting against its annotation before any
value is used, so that ``raw: "false"`` in a YAML file is an error naming the
key, not a true value, and ``seed: 1.5`` or ``model: [a]`` is not a traceback
later. Accepted annotations: ``bool``, ``int``, ``float``, ``str``, ``None``,
unions of them and ``tuple[X, ...]``. An int is a number (a float setting gets
it as a float); a bool is never an int; a list is taken for a tuple. Range
checks stay with each dataclass.

Every error is a `SettingError`: a ValueError that carries the keys it is
about, so that a caller can say where those values came from (a flag, a file)
without reading the message.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing

NAMES = {bool: "true or false", int: "an int", float: "a number", str: "a string", type(None): "null"}


class SettingError(ValueError):
    """A bad setting; ``keys`` are the settings (flag or file key names) it is about."""

    def __init__(self, message: str, *keys: str):
        super().__init__(message)
        self.keys = keys


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
def hints(cls) -> dict:
    """Field name -> annotation of a dataclass (resolved once per class)."""
    return typing.get_type_hints(cls)


def coerce(value, hint, key: str, example: str | None = None):
    """``value`` as ``hint`` wants it: an int in a float setting as a float, a list as a tuple; a
    `SettingError` ``"KEY must be TYPE, got VALUE"`` (with ``example``, a valid value, where given)
    when it does not match."""
    if not _matches(value, hint):
        raise SettingError(f"{key} must be {describe(hint)}{f' (e.g. {example})' if example else ''}, got {value!r}",
                           key)
    if hint is float:
        try:
            return float(value)
        except OverflowError:
            raise SettingError(f"{key} must be a number a float can hold, got {value!r}", key) from None
    return tuple(value) if isinstance(value, list) else value


def check_types(settings, prefix: str = "") -> None:
    """`SettingError` for the first field of a settings dataclass whose value does not match its
    annotation (named ``prefix`` + the field's name); changes nothing."""
    for field in dataclasses.fields(settings):
        coerce(getattr(settings, field.name), hints(type(settings))[field.name], prefix + field.name)


def check_fields(settings, examples: dict[str, str] | None = None) -> None:
    """`coerce` of every field of a frozen settings dataclass, in place: for a dataclass that converts
    its own values in ``__post_init__`` (`TrainConfig`)."""
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        converted = coerce(value, hints(type(settings))[field.name], field.name, (examples or {}).get(field.name))
        if converted is not value:
            object.__setattr__(settings, field.name, converted)
