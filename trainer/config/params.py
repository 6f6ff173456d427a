"""One parameter: `param()` declares it in a section (trainer/config/sections.py), `ParamSpec` is
what the schema says of it and turns any value given for it (TOML, a form, `--set`) into its type
or a `ConfigError` naming the key and what is allowed. The parsers of values with more structure
than their type are trainer/config/values.py."""
from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from typing import Any

from trainer.config.text import MAX_TEXT_LEN, short_repr, text_problem


class ConfigError(ValueError):
    """Invalid configuration. `errors` maps a dotted key ('optim.lr') to what is wrong."""

    def __init__(self, errors: dict[str, str]):
        self.errors = dict(errors)
        super().__init__("; ".join(f"{k}: {v}" for k, v in self.errors.items()))


def param(default, *, help: str, min=None, max=None, choices=None, tunable=False, prefixes=None):
    """Declare one parameter. `min`/`max` are inclusive bounds. A list parameter (default a
    list) holds distinct items, each one of `choices` when given. A string parameter with
    `prefixes` also takes any value that starts with one of them and goes on ("reasoning_gym:X")."""
    meta = {"help": help, "min": min, "max": max, "choices": tuple(choices) if choices else None,
            "tunable": tunable, "prefixes": tuple(prefixes) if prefixes else None}
    if isinstance(default, list):   # a dataclass field cannot share one mutable default
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "str", list: "list"}


@dataclass(frozen=True)
class ParamSpec:
    name: str  # dotted: "optim.lr"
    type: type
    default: Any
    help: str
    min: float | None = None
    max: float | None = None
    choices: tuple | None = None
    tunable: bool = False
    prefixes: tuple | None = None   # a value starting with one of these is allowed besides choices

    def as_json(self) -> dict[str, Any]:
        default = list(self.default) if self.type is list else self.default
        out = {"name": self.name, "type": TYPE_NAMES[self.type], "default": default,
               "min": self.min, "max": self.max,
               "choices": list(self.choices) if self.choices else None,
               "help": self.help, "tunable": self.tunable}
        if self.prefixes:   # (data.task: "reasoning_gym:NAME" besides its choices)
            out["prefixes"] = list(self.prefixes)
        return out

    def allowed(self) -> str:
        if self.type is list:
            items = ("names from " + ", ".join(repr(c) for c in self.choices) if self.choices
                     else "strings")
            return f"a list of distinct {items} (a TOML list or comma-separated; empty = none)"
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices) + "".join(
                f", or {p!r} followed by a name" for p in self.prefixes or ())
        if self.type is bool:
            return "true or false"
        lo = "-inf" if self.min is None else self.min
        hi = "inf" if self.max is None else self.max
        if self.type in (int, float):
            return f"{'an integer' if self.type is int else 'a number'} in [{lo}, {hi}]"
        return "a string"

    def coerce(self, value):
        """Return `value` as this parameter's type, or raise ConfigError naming the key."""
        err = ConfigError({self.name: f"got {short_repr(value)}; expected {self.allowed()}"})
        t = self.type
        if t is list:
            return self._coerce_list(value, err)
        if t is bool:
            if isinstance(value, bool):
                out = value
            elif isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                out = value.lower() in ("true", "1", "yes")
            else:
                raise err
        elif t is int:
            if isinstance(value, bool):
                raise err
            if isinstance(value, int):
                out = value
            elif isinstance(value, float) and value.is_integer():
                out = int(value)
            elif isinstance(value, str):
                try:
                    out = int(value.strip())
                except ValueError:
                    raise err from None
            else:
                raise err
        elif t is float:
            if isinstance(value, bool):
                raise err
            if isinstance(value, (int, float)):
                try:
                    out = float(value)
                except OverflowError:  # an integer too large for a float
                    raise err from None
            elif isinstance(value, str):
                try:
                    out = float(value.strip())
                except ValueError:
                    raise err from None
            else:
                raise err
            if not math.isfinite(out):
                raise err
        else:
            if not isinstance(value, str):
                raise err
            problem = text_problem(value, MAX_TEXT_LEN)
            if problem:
                raise ConfigError({self.name: problem})
            out = value
        if self.choices and out not in self.choices and not self._prefixed(out):
            raise err
        if self.min is not None and out < self.min:
            raise err
        if self.max is not None and out > self.max:
            raise err
        return out

    def _prefixed(self, value) -> bool:
        return isinstance(value, str) and any(value.startswith(p) and len(value) > len(p)
                                              for p in self.prefixes or ())

    def _coerce_list(self, value, err: ConfigError) -> list[str]:
        """A list, a TOML list in a string ('["a", "b"]', from the form or --set) or a
        comma-separated string ('a, b') -> the list; every item checked, duplicates refused."""
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    value = tomllib.loads(f"v = {text}")["v"]
                except (tomllib.TOMLDecodeError, RecursionError):
                    raise err from None
            else:
                value = [item.strip() for item in text.split(",")] if text else []
        if not isinstance(value, (list, tuple)):
            raise err
        out: list[str] = []
        for item in value:
            if not isinstance(item, str) or not item:
                raise ConfigError({self.name: f"item {short_repr(item)}: expected {self.allowed()}"})
            if self.choices and item not in self.choices:
                raise ConfigError({self.name: f"unknown name {short_repr(item)}; expected {self.allowed()}"})
            problem = text_problem(item, MAX_TEXT_LEN)
            if problem:
                raise ConfigError({self.name: problem})
            if item in out:
                raise ConfigError({self.name: f"{item!r} is named twice"})
            out.append(item)
        return out
