"""One declaration per serve-config key: its type (the dataclass annotation), default, description and
bounds, written once on the dataclass field that holds it.

The loader (coordinator/config.py) reads the bounds and defaults from here, so its messages name the
limits declared; the reference (coordinator/config_reference.py, `duospec config-reference`,
docs/configuration.md) prints the same declarations. No imports beyond the standard library: the
drafter's options (draft_worker/proposer.py) are declared with it too.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

REQUIRED = dataclasses.MISSING  # a key the file must give


@dataclass(frozen=True)
class Setting:
    description: str
    lo: float | None = None  # inclusive bounds of a number
    hi: float | None = None
    choices: tuple[str, ...] | None = None


def setting(default: Any, description: str, *, lo: float | None = None, hi: float | None = None,
            choices=None, factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field declared as a config key (`factory`: a default built per instance, a section)."""
    if (lo is None) != (hi is None):
        raise ValueError("a bounded setting gives both lo and hi")
    meta = {"setting": Setting(description, lo, hi, tuple(choices) if choices is not None else None)}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def declared(cls) -> list[tuple[dataclasses.Field, Setting]]:
    """The fields of dataclass `cls` declared with `setting`, in declaration order."""
    return [(f, f.metadata["setting"]) for f in dataclasses.fields(cls) if "setting" in f.metadata]


def declaration(cls, name: str) -> tuple[dataclasses.Field, Setting]:
    for f, s in declared(cls):
        if f.name == name:
            return f, s
    raise KeyError(f"{cls.__name__}.{name} is not declared with setting()")


_KINDS = {"int": int, "float": float, "bool": bool, "str": str}


def kind_of(f: dataclasses.Field) -> type | None:
    """The scalar type a key holds (its annotation without `| None`); None for a section or a union."""
    annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    return _KINDS.get(annotation.removesuffix(" | None"))


def default_of(f: dataclasses.Field) -> Any:
    """The field's default (REQUIRED when the file must give it); an enum's as its value."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default.value if isinstance(f.default, enum.Enum) else f.default
