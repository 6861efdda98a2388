"""Reading one serve-config file: YAML or TOML into a mapping, typed access to its keys that
remembers which were read (so an unknown key is named), and path resolution against the file's
folder. What the keys mean lives in coordinator/config.py."""

from __future__ import annotations

import enum
import math
import pathlib
from typing import Any

from duospec.settings import REQUIRED, declaration, default_of, kind_of


class ConfigError(ValueError):
    """A config value is missing or wrong; the message names the field and how to fix it."""


def read_mapping(path: pathlib.Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"{path}: no such file; pass --config with an existing YAML or TOML file")
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            import tomllib

            return tomllib.loads(text)
        if suffix in (".yaml", ".yml"):
            import yaml

            return yaml.safe_load(text)
    except Exception as exc:  # parse errors from either library: report where, not a traceback
        raise ConfigError(f"{path}: not valid {suffix[1:].upper()}: {exc}") from None
    raise ConfigError(f"{path}: unknown config format {suffix!r}; use .yaml, .yml or .toml")


def resolve(value: str, base_dir: pathlib.Path) -> str:
    p = pathlib.Path(value).expanduser()
    return str(p if p.is_absolute() else (base_dir / p).resolve())


def resolve_model_path(value: str, base_dir: pathlib.Path) -> str:
    # A relative path that exists next to the config is a local checkpoint; anything else may be a
    # hub name ("org/model"), which transformers resolves where the machine has network.
    candidate = pathlib.Path(value).expanduser()
    if candidate.is_absolute():
        return str(candidate)
    local = base_dir / candidate
    return str(local.resolve()) if local.exists() else value


def existing_file(f: "Fields", key: str, base_dir: pathlib.Path, *, required: bool) -> str | None:
    value = f.get(key, str, required=required, default=None)
    if value is None:
        return None
    path = resolve(value, base_dir)
    if not pathlib.Path(path).is_file():
        raise ConfigError(f"{f.where(key)}: file {path} does not exist; point it at a PEM file")
    return path


class Fields:
    """Typed access to one mapping of the config, remembering which keys were read."""

    def __init__(self, raw: Any, source: str, prefix: str):
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            label = prefix or "top level"
            raise ConfigError(f"{source}: {label}: expected a mapping, got {type(raw).__name__}")
        self.raw, self.source, self.prefix, self._seen = raw, source, prefix, set()

    def where(self, key: str) -> str:
        return f"{self.source}: {self.prefix + '.' if self.prefix else ''}{key}"

    def section(self, key: str, required: bool = False) -> "Fields | None":
        self._seen.add(key)
        if key not in self.raw and not required:
            return Fields({}, self.source, self._child(key)) if key == "server" else None
        return Fields(self.raw.get(key), self.source, self._child(key))

    def _child(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def get(self, key: str, kind: type | tuple, *, required: bool = False, default: Any = None) -> Any:
        self._seen.add(key)
        if key not in self.raw or self.raw[key] is None:
            if required:
                raise ConfigError(f"{self.where(key)}: missing; add it")
            return default
        value = self.raw[key]
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            if isinstance(kind, type):
                expected = kind.__name__
            else:
                expected = "number" if set(kind) == {int, float} else " or ".join(k.__name__ for k in kind)
            raise ConfigError(f"{self.where(key)}: expected {expected}, got {type(value).__name__} {value!r}")
        return value

    def int_in(self, key: str, lo: int, hi: int, *, default: int) -> int:
        value = self.get(key, int, default=default)
        if not lo <= value <= hi:
            raise ConfigError(f"{self.where(key)}: {value} is out of range; use an integer in [{lo}, {hi}]")
        return value

    def float_in(self, key: str, lo: float, hi: float, *, default: float) -> float:
        value = self.get(key, (int, float), default=default)
        if not math.isfinite(value) or not lo <= value <= hi:
            raise ConfigError(f"{self.where(key)}: {value} is out of range; use a number in [{lo}, {hi}]")
        return float(value)

    def choice(self, key: str, options, *, default: str) -> str:
        value = self.get(key, str, default=default)
        if value not in options:
            raise ConfigError(f"{self.where(key)}: {value!r} is not one of {', '.join(options)}")
        return value

    def setting(self, cls, key: str) -> Any:
        """`key` read as dataclass `cls` declares it (duospec/settings.py): its type, its bounds or
        choices, and its default when the file leaves it out. A key whose default is None is optional:
        left out it stays None, given it is checked."""
        f, s = declaration(cls, key)
        default = default_of(f)
        if default is None:
            self._seen.add(key)
            if self.raw.get(key) is None:
                return None
        kind = kind_of(f)
        if s.choices is not None:
            value = self.choice(key, s.choices, default=default)
            return type(f.default)(value) if isinstance(f.default, enum.Enum) else value
        if s.lo is not None and kind is int:
            return self.int_in(key, s.lo, s.hi, default=default)
        if s.lo is not None and kind is float:
            return self.float_in(key, s.lo, s.hi, default=default)
        if default is REQUIRED:
            return self.get(key, kind, required=True)
        return self.get(key, kind, default=default)

    def reject_unknown(self) -> None:
        unknown = sorted(set(self.raw) - self._seen)
        if unknown:
            raise ConfigError(f"{self.where(unknown[0])}: unknown key; check the spelling (known: {sorted(self._seen)})")
