"""Forking a run: a NEW run directory that starts from another run's checkpoint at step N, with
other settings.

    child = fork_run_dir("runs/demo-1", 40, "runs/demo-1-lr", {"optim.lr": 3e-5})
    # then: Runner(load_config(child), child, resume=True) trains steps 41, 42, ...

The child gets the parent's checkpoint at step N (files hard-linked where the file system allows,
copied otherwise; the parent's folder is only read), a config.toml that is the parent's config
with the overrides, and fork.json naming its parent. The checkpoint's state.json is rewritten in
the child with the overridden knob values, so neither this resume nor a later one of the child
brings the parent's knob values back over the overrides. Steps continue the parent's numbering:
the child's first step is N + 1 and trains on what the parent's step N + 1 drew (same cursor,
RNG, buffer), with the new settings.

What a checkpoint cannot carry into another config is refused by name (run_state.carry_problems,
which a resume with --set checks too). A live parent can be forked: a checkpoint folder is only
visible once complete (checkpoint.py renames it into place), and one the parent deletes while
it is copied (run.keep_checkpoints) is reported, the half copy removed.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from trainer import config as config_mod
from trainer.run import checkpoint
from trainer.run import state as run_state

FORK_FILE = "fork.json"
CONFIG_FILE = "config.toml"


def parent_config(parent_dir: str | Path) -> config_mod.Config:
    """The config a run directory was started with (its config.toml); ConfigError naming what is
    wrong when it is no run directory."""
    parent = Path(parent_dir)
    if not parent.is_dir():
        raise config_mod.ConfigError({"--fork": f"{parent} is not a directory: no such run"})
    saved = parent / CONFIG_FILE
    if not saved.is_file():
        raise config_mod.ConfigError({"--fork": f"{parent} has no {CONFIG_FILE}: not a run directory"})
    return config_mod.loads_toml(saved.read_text())


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    """The steps of the complete checkpoints of a run directory, oldest first."""
    return [s for s in map(checkpoint.step_of, checkpoint.list_checkpoints(run_dir)) if s is not None]


def find_checkpoint(run_dir: str | Path, step: int) -> Path:
    """The complete checkpoint folder at `step`; ConfigError listing the ones there otherwise."""
    for p in checkpoint.list_checkpoints(run_dir):
        if checkpoint.step_of(p) == step:
            return p
    steps = checkpoint_steps(run_dir)
    there = (f"its checkpoints are at step{'s' if len(steps) > 1 else ''} "
             + ", ".join(map(str, steps))) if steps else "it has no complete checkpoint"
    raise config_mod.ConfigError({"--from-step": f"{run_dir} has no checkpoint at step {step}; {there}"})


def child_config(base: config_mod.Config, overrides: dict[str, Any] | list[str],
                 checkpoint_dir: Path, step: int) -> tuple[config_mod.Config, dict[str, Any]]:
    """(the child's config: `base` + overrides, {key: coerced value} of the overrides). Raises
    ConfigError naming every override the checkpoint cannot carry."""
    pairs = dict(overrides) if isinstance(overrides, dict) else dict(
        config_mod.parse_override(o) for o in overrides)
    cfg = config_mod.apply_overrides(base, pairs)
    state = json.loads((checkpoint_dir / "state.json").read_text())
    problems = run_state.carry_problems(state, cfg, checkpoint_dir)
    if cfg.run.max_steps <= step:
        problems["run.max_steps"] = (f"{cfg.run.max_steps} is not past the fork step {step}: the "
                                     "new run would train nothing; set run.max_steps higher")
    if problems:
        raise config_mod.ConfigError(problems)
    return cfg, {k: cfg.get(k) for k in pairs}


def fork_run_dir(parent_dir: str | Path, step: int, out: str | Path,
                 overrides: dict[str, Any] | list[str] = (), *, base: config_mod.Config | None = None,
                 overwrite: bool = False, extra: dict[str, Any] | None = None) -> Path:
    """Make `out` a new run directory forked from `parent_dir`'s checkpoint at `step` (see the
    module doc). `base`: the parent's config when the caller holds it (the dashboard's row),
    else the parent's config.toml. `extra` goes into fork.json (e.g. the dashboard's run ids).
    Returns `out`; raises ConfigError (what is wrong, by name) or FileExistsError."""
    parent = Path(parent_dir)
    if base is None:
        base = parent_config(parent)
    elif not parent.is_dir():
        raise config_mod.ConfigError({"--fork": f"{parent} is not a directory: no such run"})
    source = find_checkpoint(parent, step)
    cfg, applied = child_config(base, overrides, source, step)
    if Path(out).resolve() == parent.resolve():
        raise config_mod.ConfigError({"--out": "the fork needs a directory of its own, not its parent's"})
    child = run_state.prepare_run_dir(out, overwrite=overwrite)
    try:
        _copy_checkpoint(source, checkpoint.checkpoint_root(child) / source.name, cfg, applied)
    except BaseException:
        shutil.rmtree(checkpoint.checkpoint_root(child), ignore_errors=True)
        raise
    (child / CONFIG_FILE).write_text(config_mod.to_toml(cfg))
    record = {"parent": str(parent.resolve()), "step": step, "checkpoint": source.name,
              "overrides": applied, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(extra or {})}
    (child / FORK_FILE).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return child


def read_fork(run_dir: str | Path) -> dict[str, Any] | None:
    """fork.json of a run directory: {parent, step, checkpoint, overrides, ...}, None for a run
    that was not forked."""
    path = Path(run_dir) / FORK_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _copy_checkpoint(source: Path, dest: Path, cfg: config_mod.Config, applied: dict) -> None:
    """Link (else copy) every file of `source` into `dest`, but write state.json anew with the
    child's knob values and config (a new file: the parent's state.json is never written)."""
    try:
        shutil.copytree(source, dest, copy_function=_link_or_copy,
                        ignore=lambda d, names: ["state.json"] if Path(d) == source else [])
        state = json.loads((source / "state.json").read_text())
    except OSError:   # also shutil.Error, copytree's list of the files that failed
        if source.is_dir():
            raise
        raise config_mod.ConfigError({"--from-step": (
            f"the checkpoint {source} disappeared while it was copied: the running parent keeps "
            "only its newest run.keep_checkpoints; fork from a newer one")}) from None
    knobs = set(state.get("knobs") or {})
    state["knobs"] = {**(state.get("knobs") or {}),
                      **{k: v for k, v in applied.items() if k in knobs}}
    state["config"] = config_mod.apply_overrides(cfg, state["knobs"]).to_dict()
    state["device_s"] = {}   # a fork pays from its fork step: the parent's hours are the parent's
    (dest / "state.json").write_text(json.dumps(state, indent=2, default=str) + "\n")


def _link_or_copy(src: str, dst: str) -> str:
    """A hard link (no bytes copied: checkpoints can be many GB); a copy across file systems."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst
