"""Typed TOML tables: the one loader from a parsed TOML table to a dataclass, and the rules every value obeys.

Both the trainer's config (trainer.rules.config) and the control plane's run spec (dilococtl.spec) are read
with it, so a bad key or value is reported the same way in both.

Every problem is a ConfigError whose message is one line, `KEY: problem`. KEY is the key's path from
the top of the document: tables joined by '.', array items indexed from 0 (`diloco.h`,
`sites[1].hosts[0]`). Whoever read the file puts its name in front: `FILE: KEY: problem`.

`table_from_dict(cls, table, where)` builds dataclass `cls` from `table`:
- a value that is not a table is refused (`KEY: expected a table, got str`);
- a key `cls` has no field for is refused, naming the closest known key when one is close
  (`diloco.roundz: unknown key 'roundz' (did you mean 'rounds'?)`), else every known key;
- each value is checked against its field's type (`diloco.h: expected int, got '20'`): int (not a
  bool), float (an int is taken, and stored as a float), bool, str, Literal choices, unions
  (`float | None`), `list[T]` item by item (`sites[0].hosts[1]: expected str, got 7`) and
  `dict[str, float]` (a table of numbers); a field whose type is a dataclass is a nested table, read
  the same way;
- a key whose field has no default must be there (`run.name: required key is missing`);
- a dataclass may spell out its shorthands first: a static method `expand_table(table) -> table` runs
  before any check (DilocoConfig: `h = "auto"`, codec presets).
`check_values(sections)` then holds every value to what no type says: numbers finite, text printable.

No torch import (the control plane checks run specs with this).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Iterable
from typing import Any, Literal, TypeVar


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the key (`KEY: problem`)."""


MAX_WAIT_S = 86400.0  # the longest wait or timeout any knob may set: a day (every wait has a finite bound)
GOT_MAX = 200  # characters of a bad value's repr an error quotes (a table may be huge: the line stays short)

T = TypeVar("T")


def key_path(where: str, key: str) -> str:
    """The path of `key` in the table at `where` ("" for the document's top)."""
    return f"{where}.{key}" if where else key


def unknown_key(name: str, key: str, known: Iterable[str]) -> str:
    """`diloco.roundz: unknown key 'roundz' (did you mean 'rounds'?)`; the known keys when none is close."""
    known = sorted(known)
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    if close:
        return f"{name}: unknown key {str(key)!r} (did you mean {close[0]!r}?)"
    return f"{name}: unknown key (known: {', '.join(known)})"


def table_from_dict(cls: type[T], data: Any, where: str) -> T:
    """Build dataclass `cls` from the TOML table `data` found at key path `where` (see the module docstring)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a table, got {type(data).__name__}")
    expand = getattr(cls, "expand_table", None)
    if expand is not None:
        data = expand(data)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        name = key_path(where, key)
        if key not in fields:
            raise ConfigError(unknown_key(name, key, fields))
        kwargs[key] = _typed(value, hints[key], name)
    for key, f in fields.items():
        if key not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{key_path(where, key)}: required key is missing")
    return cls(**kwargs)


def _typed(value: Any, hint: Any, name: str) -> Any:
    """`value` of the key `name`, checked against the type `hint` and stored as it (an int for a float: a float)."""
    if dataclasses.is_dataclass(hint):
        return table_from_dict(hint, value, name)
    origin = typing.get_origin(hint)
    if origin is list:
        if not isinstance(value, list):
            raise _mistyped(name, hint, value)
        (item,) = typing.get_args(hint)
        return [_typed(v, item, f"{name}[{i}]") for i, v in enumerate(value)]
    if not _type_ok(value, hint):
        raise _mistyped(name, hint, value)
    if hint is float:
        return float(value)
    if origin is dict and typing.get_args(hint)[1] is float:
        return {k: float(v) for k, v in value.items()}
    return value


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(hint))
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is type(None):
        return value is None
    if origin is dict:
        kt, vt = typing.get_args(hint)
        return isinstance(value, dict) and all(_type_ok(k, kt) and _type_ok(v, vt) for k, v in value.items())
    if origin is list:
        (vt,) = typing.get_args(hint)
        return isinstance(value, list) and all(_type_ok(v, vt) for v in value)
    return isinstance(value, hint)


def _mistyped(name: str, hint: Any, value: Any) -> ConfigError:
    got = repr(value)
    return ConfigError(f"{name}: expected {_describe(hint)}, got {got[:GOT_MAX]}{'...' if len(got) > GOT_MAX else ''}")


def _describe(hint: Any) -> str:
    """What a value of type `hint` is, in an error: `int`, `'sync', 'overlap'`, `a list of str`."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return ", ".join(map(repr, typing.get_args(hint)))
    if origin is list:
        return f"a list of {_describe(typing.get_args(hint)[0])}"
    if origin is dict:
        vt = typing.get_args(hint)[1]
        return "a table of numbers" if vt is float else f"a table of {_describe(vt)}"
    return getattr(hint, "__name__", str(hint))


def check_values(sections: Iterable[tuple[str, Any]]) -> None:
    """What holds for every value of each (key path, dataclass) section, list items included: numbers
    are finite (inf or nan as a timeout, a rate or a learning rate hangs or poisons a run) and text has
    no control characters (a newline splits a command or a record line, NUL cannot reach the OS)."""
    for where, obj in sections:
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            for i, item in enumerate(v if isinstance(v, list) else [v]):
                key = f"{where}.{f.name}" + (f"[{i}]" if isinstance(v, list) else "")
                if isinstance(item, float) and not math.isfinite(item):
                    raise ConfigError(f"{key}: must be a finite number, got {item}")
                if isinstance(item, str) and not item.isprintable():
                    raise ConfigError(f"{key}: control characters are not allowed, got {item!r}")
