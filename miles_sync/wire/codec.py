"""Generic encoding of frozen records (dataclasses) to JSON-safe values and back, driven by their type hints.

Every record that crosses a process, HTTP or Ray boundary goes through these two functions, so there is one
decoder to get right: wire bodies (miles_sync.wire.protocol), engine reports (miles_sync.sync.selector) and config
(miles_sync.config). Supported field types: bool, int, float, str, None, str enums, nested records, tuple[X, ...],
fixed tuples, list[X], dict[str, X], unions of those, and Any (any JSON value, passed through unchecked).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from enum import Enum
from typing import Any, TypeVar

from miles_sync.wire.text import allowed_values

__all__ = ["WireEnum", "decode", "encode"]


class WireEnum(str, Enum):
    """A string enum whose wire form is its value; `str()` gives the value on every Python version."""

    def __str__(self) -> str:
        return self.value


R = TypeVar("R")


def encode(record: object) -> dict[str, Any]:
    """The JSON-safe dict of a record: every field, enums as values, tuples as lists, nested records as dicts."""
    if not _is_record(record):
        raise TypeError(f"encode expects a dataclass instance, got {type(record).__name__}")
    return _encode_value(record)


def decode(cls: type[R], obj: object, *, allow_unknown: bool = False) -> R:
    """Build a `cls` record from a decoded JSON value, checking every field against its type hint.

    Ints are accepted for float fields; bools are rejected for int fields; lists become tuples. Unknown keys are
    rejected unless `allow_unknown` (for answers of real servers, which carry more keys than we read). Raises
    ValueError naming every offending field by its dotted path, with the expected type or the allowed values;
    a record's own validation (`__post_init__`) runs last and its message is prefixed with the record's path.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"decode expects a dataclass type, got {cls!r}")
    try:
        return _decode_record(cls, obj, "", allow_unknown)
    except _DecodeError as e:
        raise ValueError(f"invalid {cls.__name__}: " + "; ".join(e.problems)) from None


def _is_record(value: object) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _encode_value(value: object) -> Any:
    if isinstance(value, Enum):
        return value.value
    if _is_record(value):
        return {f.name: _encode_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_encode_value(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _encode_value(v) for k, v in value.items()}
    return value


class _DecodeError(Exception):
    def __init__(self, problems: list[str]) -> None:
        super().__init__(problems)
        self.problems = problems


@functools.cache
def _record_fields(cls: type) -> dict[str, tuple[Any, bool]]:
    """name -> (resolved type hint, is_required) for the init fields of a record class."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: (hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        for f in dataclasses.fields(cls)
        if f.init
    }


def _decode_record(cls: type, obj: object, path: str, allow_unknown: bool) -> Any:
    where = f"{path}: " if path else ""
    fields = _record_fields(cls)
    if not isinstance(obj, Mapping):
        raise _DecodeError([f"{where}expected an object ({cls.__name__}), got {_describe_value(obj)}"])
    problems = []
    unknown = [k for k in obj if k not in fields]
    if unknown and not allow_unknown:
        problems.append(
            f"{where}unknown key(s) {', '.join(repr(k) for k in unknown)} (allowed: {', '.join(fields) or 'none'})"
        )
    missing = [name for name, (_, required) in fields.items() if required and name not in obj]
    if missing:
        problems.append(f"{where}missing required key(s) {', '.join(repr(k) for k in missing)}")
    values = {}
    for name, (hint, _) in fields.items():
        if name in obj:
            try:
                values[name] = _decode_value(hint, obj[name], f"{path}.{name}" if path else name, allow_unknown)
            except _DecodeError as e:
                problems.extend(e.problems)
    if problems:
        raise _DecodeError(problems)
    try:
        return cls(**values)
    except ValueError as e:
        raise _DecodeError([f"{where}{e}"]) from None


def _decode_value(hint: Any, value: object, path: str, allow_unknown: bool) -> Any:
    if hint is Any:  # an opaque JSON value passed through as decoded (a PEFT adapter_config, say)
        return value
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        return _decode_union(hint, value, path, allow_unknown)
    if origin in (tuple, list):
        return _decode_sequence(hint, value, path, allow_unknown)
    if origin in (dict, Mapping):
        return _decode_mapping(hint, value, path, allow_unknown)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _decode_record(hint, value, path, allow_unknown)
    if isinstance(hint, type) and issubclass(hint, Enum):
        if isinstance(value, hint):
            return value
        try:
            return hint(value)
        except (ValueError, TypeError):
            raise _DecodeError([f"{path}: {value!r} is not one of {allowed_values(hint)}"]) from None
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif hint is str:
        ok = isinstance(value, str)
    elif hint is type(None):
        ok = value is None
    else:
        raise TypeError(f"{path}: type hint {hint!r} is not supported by the record decoder")
    if not ok:
        raise _DecodeError([f"{path}: expected {_describe_type(hint)}, got {_describe_value(value)}"])
    return value


def _decode_union(hint: Any, value: object, path: str, allow_unknown: bool) -> Any:
    args = typing.get_args(hint)
    if value is None and type(None) in args:
        return None
    alternatives = [a for a in args if a is not type(None)]
    if len(alternatives) == 1 and value is not None:
        return _decode_value(alternatives[0], value, path, allow_unknown)
    for alternative in alternatives:
        try:
            return _decode_value(alternative, value, path, allow_unknown)
        except _DecodeError:
            continue
    raise _DecodeError([f"{path}: expected {_describe_type(hint)}, got {_describe_value(value)}"])


def _decode_sequence(hint: Any, value: object, path: str, allow_unknown: bool) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if not isinstance(value, (list, tuple)):
        raise _DecodeError([f"{path}: expected {_describe_type(hint)}, got {_describe_value(value)}"])
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            raise _DecodeError([f"{path}: expected a list of length {len(args)}, got length {len(value)}"])
        item_hints = list(args)
    else:
        item_hints = [args[0]] * len(value)
    items, problems = [], []
    for i, (item_hint, item) in enumerate(zip(item_hints, value)):
        try:
            items.append(_decode_value(item_hint, item, f"{path}[{i}]", allow_unknown))
        except _DecodeError as e:
            problems.extend(e.problems)
    if problems:
        raise _DecodeError(problems)
    return tuple(items) if origin is tuple else items


def _decode_mapping(hint: Any, value: object, path: str, allow_unknown: bool) -> Any:
    key_hint, value_hint = typing.get_args(hint)
    if not isinstance(value, Mapping):
        raise _DecodeError([f"{path}: expected {_describe_type(hint)}, got {_describe_value(value)}"])
    result, problems = {}, []
    for key, item in value.items():
        try:
            result[_decode_value(key_hint, key, f"{path} key {key!r}", allow_unknown)] = _decode_value(
                value_hint, item, f"{path}[{key!r}]", allow_unknown
            )
        except _DecodeError as e:
            problems.extend(e.problems)
    if problems:
        raise _DecodeError(problems)
    return result


_JSON_NAMES = {bool: "bool", int: "int", float: "float", str: "str", type(None): "null"}


def _describe_type(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(_describe_type(a) for a in args)
    if origin in (tuple, list):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return f"a list of length {len(args)}"
        return f"a list of {_describe_type(args[0])}"
    if origin in (dict, Mapping):
        return f"an object of {_describe_type(args[1])}"
    if isinstance(hint, type) and issubclass(hint, Enum):
        return f"one of {allowed_values(hint)}"
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return f"an object ({hint.__name__})"
    return _JSON_NAMES.get(hint, repr(hint))


def _describe_value(value: object) -> str:
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return f"a list of length {len(value)}"
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return f"{_JSON_NAMES.get(type(value), type(value).__name__)} {shown}"
