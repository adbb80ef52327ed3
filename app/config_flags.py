"""Command-line flags derived from a config dataclass's fields (``EngineConfig``): each field
declared with ``mlx_engine.config.option`` becomes ``--field-name``, its type, choices and help
taken from the field, so every default is written once, on the field.

A flag's argparse default is None ("not given"), so an option left out keeps the dataclass's own
default (and a command can tell what the user asked for); the help names the field's default.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterable
from typing import Any


def flag(option: str) -> str:
    """An option's command-line spelling: ``cache_gb`` -> ``--cache-gb``."""
    return "--" + option.replace("_", "-")


def _scalar(tp: Any) -> type:
    """The argparse type of a field annotation (``int | None`` -> int; Any -> str)."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0] if len(args) == 1 else str
    return tp if tp in (int, float, str) else str


def flag_fields(cls: type, names: Iterable[str]) -> list[dataclasses.Field]:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = []
    for name in names:
        f = fields[name]
        if "flag" not in f.metadata:
            raise ValueError(f"{cls.__name__}.{name} is not declared as a flag (mlx_engine.config.option)")
        out.append(f)
    return out


def add_config_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, names: Iterable[str]
) -> None:
    """Add ``--name`` for each of ``cls``'s fields ``names`` (declared with ``option``)."""
    hints = typing.get_type_hints(cls)
    for f in flag_fields(cls, names):
        meta = f.metadata["flag"]
        spellings = [flag(f.name)] + ([meta["short"]] if meta["short"] else [])
        kwargs: dict[str, Any] = {
            "type": _scalar(hints[f.name]),
            "default": None,
            "help": meta["help"].format(default=f.default).replace("%", "%%"),
        }
        if meta["choices"] is not None:
            kwargs["choices"] = meta["choices"]
        if meta["metavar"] is not None:
            kwargs["metavar"] = meta["metavar"]
        parser.add_argument(*spellings, **kwargs)


def config_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The flag-declared fields of ``cls`` that ``args`` gives (present and not None)."""
    out = {}
    for f in dataclasses.fields(cls):
        if "flag" in f.metadata and getattr(args, f.name, None) is not None:
            out[f.name] = getattr(args, f.name)
    return out
