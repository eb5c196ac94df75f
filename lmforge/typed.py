"""Dataclasses from plain dicts (YAML, JSON, overrides), with type checks and "did you mean" for
unknown keys. Every config lmforge reads goes through ``dataclass_from_dict``."""

from __future__ import annotations

import dataclasses
import difflib
import math
import reprlib
import types
import typing
from typing import Any

from lmforge.errors import LMForgeError


# Reprs of user values in messages stay short: a YAML "billion laughs" recipe (nested alias lists, a few hundred
# bytes) is gigabytes as a full repr. maxlevel and the max* counts keep reprlib from walking all of it.
_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 6
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 80
MAX_REPR = 200


def short_repr(value: Any) -> str:
    """``repr(value)`` for an error message, cut to at most ``MAX_REPR`` characters."""
    text = _REPR.repr(value)
    return text if len(text) <= MAX_REPR else text[:MAX_REPR - 3] + "..."


def section_error(name: str, value: Any) -> LMForgeError:
    """A config section given as something other than a mapping (None, '', a number, a list)."""
    return LMForgeError(f"config section {name!r} must be a mapping, got {short_repr(value)} (to change one key "
                        f"write {name}.KEY=VALUE; to keep the defaults leave the section out)")


def dataclass_from_dict(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    if values is None:
        values = {}
    if not isinstance(values, dict):
        if not prefix:
            raise LMForgeError(f"a config must be a mapping of sections, got {short_repr(values)}")
        raise section_error(prefix, values)
    resolve = getattr(cls, "resolve_dict", None)
    if resolve is not None:
        values = resolve(dict(values))
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in fields:
            raise LMForgeError(_unknown_key_message(dotted, key, cls, prefix))
        hint = hints[key]
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            if not isinstance(value, dict):  # None too: `training: null` would silently mean all defaults
                raise section_error(dotted, value)
            kwargs[key] = dataclass_from_dict(hint, value, prefix=dotted)
        elif key in getattr(cls, "built_separately", ()):
            continue  # e.g. RunConfig.model: its dataclass depends on another key
        else:
            kwargs[key] = _coerce(value, hint, dotted)
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise LMForgeError(f"invalid config section {prefix or '<root>'!r}: {e}") from e
    return obj


def _unknown_key_message(dotted: str, key: str, cls: type, prefix: str) -> str:
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    where = f"{prefix}." if prefix else ""
    hint = f" Did you mean '{where}{close[0]}'?" if close else ""
    return f"unknown config key '{dotted}'.{hint} Valid keys here: {', '.join(where + n for n in names)}"


def _number(value: Any) -> float | int | None:
    """``value`` as a number, or None. A number written as text counts: YAML 1.1 reads ``lr: 1e-3`` as the
    string '1e-3'."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        for parse in (int, float):  # int first: a big integer keeps every digit
            try:
                return parse(value)
            except ValueError:
                pass
    return None


def _coerce(value: Any, hint: Any, dotted: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, dotted)
            except LMForgeError as e:
                errors.append(str(e))
        raise LMForgeError(errors[0] if errors else f"bad value for {dotted}: {short_repr(value)}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise LMForgeError(f"config key '{dotted}' expects a list, got {short_repr(value)}")
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{dotted}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise LMForgeError(f"config key '{dotted}' expects a mapping, got {short_repr(value)}")
        return dict(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise LMForgeError(f"config key '{dotted}' expects true or false, got {short_repr(value)}")
    if hint in (int, float):
        number = _number(value)
        finite = number is not None and (isinstance(number, int) or math.isfinite(number))
        if hint is int and (not finite or int(number) != number):
            raise LMForgeError(f"config key '{dotted}' expects an integer, got {short_repr(value)}")
        try:
            if finite:
                return hint(number)
        except OverflowError:  # an integer too large for a float
            pass
        raise LMForgeError(f"config key '{dotted}' expects {'a number' if number is None else 'a finite number'}, "
                           f"got {short_repr(value)}")
    if hint is str:
        if isinstance(value, (dict, list)):
            raise LMForgeError(f"config key '{dotted}' expects a string, got {short_repr(value)}")
        return "" if value is None else str(value)
    return value
