"""Configs in and out: a shipped preset or a TOML file, then dotted `section.key=value`
overrides (every error collected into one `ConfigError`), knob changes as a whole, and the TOML
a config is written back as."""
from __future__ import annotations

import os
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

import tomli_w

from trainer.config.checks import check
from trainer.config.params import ConfigError
from trainer.config.schema import SECTIONS, Config, param_spec
from trainer.config.sections import BUILTIN_MODELS, IMPORTED_MODELS

PRESETS_PACKAGE = "trainer.presets"


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files(PRESETS_PACKAGE).iterdir()
                  if p.name.endswith(".toml"))


def preset_dict(name: str) -> dict[str, dict[str, Any]]:
    if name not in preset_names():
        raise ConfigError({"preset": f"unknown preset {name!r}; presets: " + ", ".join(preset_names())})
    text = resources.files(PRESETS_PACKAGE).joinpath(name + ".toml").read_text()
    return tomllib.loads(text)


def preset_config(name: str, *, project_dir: str | Path = ".",
                  var_dir: str | Path | None = None) -> "Config":
    """A shipped preset, its relative model.path made whole. A preset names its model relative to
    the project folder (var/models/..., where import-gguf writes by default); var/ there is the
    RLPILOT_VAR_DIR of whoever runs it (default <project_dir>/var). The one rule for the CLI
    (project_dir: where it runs) and the web (the server's project folder and var dir)."""
    cfg = from_dict(preset_dict(name))
    path = cfg.model.path
    if not _shipped(path) and not Path(path).is_absolute():
        project = Path(project_dir)
        var = Path(var_dir or os.environ.get("RLPILOT_VAR_DIR") or project / "var")
        head, _, rest = path.partition("/")
        cfg.set("model.path", str((var / rest if head == "var" and rest else project / path).resolve()))
    return cfg


def _shipped(path: str) -> bool:
    """Is `path` the name of a model rlpilot ships ("builtin", "builtin-tools")?"""
    return path in BUILTIN_MODELS


def preset_requires(name: str) -> str | None:
    """What a preset needs beyond the default install, or None. A preset whose model.path is
    not "builtin" needs a model directory of your own: it is opt-in. `python -m trainer presets`
    and the launch form say so with this text (the per-preset tests skip it with it too)."""
    path = preset_dict(name).get("model", {}).get("path", "builtin")
    if _shipped(path):
        return None
    source = IMPORTED_MODELS.get(Path(path).name)
    how = (f"create it with `python -m trainer import-gguf {source}`" if source
           else "a model directory of your own")
    return f"opt-in: needs model.path = {path} ({how}; docs/models.md)"


def from_dict(data: dict[str, Any], base: Config | None = None) -> Config:
    """Apply a nested {section: {key: value}} mapping to `base` (defaults if None).

    Every error is collected, so the user sees all of them at once."""
    cfg = base.copy() if base is not None else Config()
    errors: dict[str, str] = {}
    if not isinstance(data, dict):
        raise ConfigError({"config": "expected a table of sections"})
    pairs = []
    for section, values in data.items():
        if section not in SECTIONS:
            errors[section] = "unknown section; sections are " + ", ".join(SECTIONS)
        elif not isinstance(values, dict):
            errors[section] = "expected a table of keys"
        else:
            pairs += [(f"{section}.{name}", value) for name, value in values.items()]
    return _set_checked(cfg, pairs, errors)


def loads_toml(text: str, base: Config | None = None) -> Config:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError({"toml": f"not valid TOML: {e}"}) from None
    except RecursionError:
        raise ConfigError({"toml": "not valid here: nested too deeply"}) from None
    return from_dict(data, base)


def parse_override(item: str) -> tuple[str, Any]:
    """'optim.lr=3e-5' -> ('optim.lr', 3e-5). The value is read as a TOML value when it parses
    as one (numbers, booleans, quoted strings), otherwise taken as a bare string."""
    if "=" not in item:
        raise ConfigError({item: "expected section.key=value"})
    key, raw = item.split("=", 1)
    key, raw = key.strip(), raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def apply_overrides(cfg: Config, overrides: dict[str, Any] | Iterable[str]) -> Config:
    """Apply dotted overrides ({'optim.lr': 1e-5} or ['optim.lr=1e-5']), collecting all errors."""
    if not isinstance(overrides, dict):
        pairs = [parse_override(o) for o in overrides]
    else:
        pairs = list(overrides.items())
    return _set_checked(cfg.copy(), pairs, {})


def _set_checked(cfg: Config, pairs: list[tuple[str, Any]], errors: dict[str, str]) -> Config:
    """Set every (dotted key, value) on `cfg`, then check it whole; every error raised at once
    (with `errors` already found), so the user sees all of them."""
    for key, value in pairs:
        try:
            cfg.set(key, value)
        except ConfigError as e:
            errors.update(e.errors)
    if errors:
        raise ConfigError(errors)
    check(cfg)
    return cfg


def load(source: str, overrides: dict[str, Any] | Iterable[str] = ()) -> Config:
    """Load a preset name or a TOML file path, then apply overrides."""
    path = Path(source)
    if source in preset_names():
        cfg = preset_config(source)
    elif path.suffix == ".toml" and path.is_file():
        cfg = loads_toml(path.read_text())
    else:
        raise ConfigError({"config": f"{source!r} is neither a preset ({', '.join(preset_names())}) "
                                     "nor an existing .toml file"})
    return apply_overrides(cfg, overrides)


def apply_knob_change(cfg: Config, knobs: dict[str, Any]) -> tuple[Config, dict[str, dict]]:
    """A knob change as a whole: the new config and {key: {"old", "new"}}, or ConfigError with
    every key that is unknown, not tunable or out of range (nothing is applied then)."""
    errors: dict[str, str] = {}
    for key, value in knobs.items():
        try:
            spec = param_spec(key)
            if not spec.tunable:
                raise ConfigError({key: "cannot change during a run"})
            spec.coerce(value)
        except ConfigError as e:
            errors.update(e.errors)
    if errors:
        raise ConfigError(errors)
    new = apply_overrides(cfg, knobs)
    if not cfg.episode.multi_turn and new.episode.multi_turn:
        # the engine was built without an environment (trainer/run/engines.py)
        raise ConfigError({"episode.max_turns": "this run was launched single-turn "
                           "(episode.max_turns = 1): it has no environment to answer a turn; "
                           "fork it with episode.max_turns > 1"})
    return new, {k: {"old": cfg.get(k), "new": new.get(k)} for k in knobs}



def to_toml(cfg: Config) -> str:
    """Serialise a config as TOML with tomli-w (round-trips through loads_toml). Every shipped
    preset comes out as it is written; a non-empty list takes one line per item and a tab stays a
    tab in a string (both valid TOML: read it with a TOML parser, never line by line)."""
    return tomli_w.dumps(cfg.to_dict())
