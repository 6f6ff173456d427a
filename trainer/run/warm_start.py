"""GRESO warm start: a NEW run starts from another run's GRESO statistics (`greso.warm_start`).

    greso.warm_start = "runs/greso-1"     # a run directory, finished or live (only read)

At the start of a new run (never a resume or a fork: their own checkpoint holds their GRESO
state, and it wins), the filter takes the source's latest checkpoint's p_easy / p_hard and the
reward traces of the prompts both runs share by problem id, aged as they were at the source's
end (GresoFilter.import_history). Without it a new run's first epoch has no history and skips
nothing; with it, prompts the source found all-correct or all-wrong are skippable from step 1.
The run_started event says how many prompts came warm (`greso_warm_start`), and the report.

A problem id names the same problem in two runs only when the keys that generate or read the
problems agree (SAME_PROBLEMS: the task, its file, its generator's settings, the seed); any
other difference (the model, the learning rate, data.train_size: ids are shared up to the
smaller) is allowed: that is the transfer. What is wrong is refused with a ConfigError naming
`greso.warm_start` and the problem, before a run directory is made (the CLI) or a run is
queued (the dashboard's launch), and again when the run starts.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer import config as config_mod
from trainer.run import checkpoint

KEY = "greso.warm_start"
CONFIG_FILE = "config.toml"
# what a problem id means: the task, the file it reads, its generator's settings and seed
SAME_PROBLEMS = ("data.task", "data.path", "data.max_list_len", "data.length_alpha",
                 "data.max_operand", "run.seed")


def _refuse(message: str) -> config_mod.ConfigError:
    return config_mod.ConfigError({KEY: message})


def _path_value(key: str, value: Any) -> Any:
    """data.path compared as the file it names (a relative and an absolute path to one file agree)."""
    return str(Path(value).resolve()) if key == "data.path" and value else value


def source_state(cfg: config_mod.Config) -> tuple[dict, Path]:
    """(the GRESO state of the latest checkpoint of the run `cfg.greso.warm_start` names, that
    checkpoint's folder). Raises ConfigError naming what is wrong: no such directory, no run
    there, a task whose problem ids mean other problems, no checkpoint, no GRESO state in it."""
    source = Path(cfg.greso.warm_start)
    if not source.is_dir():
        raise _refuse(f"{source} is not a directory: no such run")
    saved = source / CONFIG_FILE
    if not saved.is_file():
        raise _refuse(f"{source} has no {CONFIG_FILE}: not a run directory")
    try:
        theirs = config_mod.loads_toml(saved.read_text())
    except config_mod.ConfigError as e:
        raise _refuse(f"{saved} is not a valid config: " + "; ".join(
            f"{k}: {v}" for k, v in e.errors.items())) from None
    differ = [k for k in SAME_PROBLEMS
              if _path_value(k, theirs.get(k)) != _path_value(k, cfg.get(k))]
    if differ:
        raise _refuse("the runs' problem ids name different problems: " + "; ".join(
            f"{k} is {theirs.get(k)!r} there, {cfg.get(k)!r} here" for k in differ))
    try:
        path = checkpoint.latest(source)
    except FileNotFoundError:
        raise _refuse(f"{source} has no checkpoint yet: no GRESO statistics to start from") from None
    state = read_greso(path)
    if not state or not isinstance(state.get("traces"), dict):
        raise _refuse(f"the checkpoint {path} holds no GRESO state")
    return state, path


def read_greso(path: Path) -> dict | None:
    """The GRESO part of a checkpoint's trainer state, read without its tensors (the optimizer
    moments of a large model are not needed for it); None when it has none."""
    where = Path(path) / checkpoint.STATE_FILE
    if not where.is_file():   # the old format: the whole state, through the restricted unpickler
        return (checkpoint.read_trainer_state(path) or {}).get("greso")
    try:
        doc = json.loads(where.read_text())
        greso = (doc.get("data") or {}).get("greso")
        return None if greso is None else checkpoint.decode(json.dumps(greso), {})
    except (ValueError, AttributeError) as e:
        raise _refuse(f"the checkpoint {where} cannot be read: {e}") from None


def check(cfg: config_mod.Config) -> None:
    """Refuse (ConfigError) a `greso.warm_start` that names no usable source; nothing to do
    without one."""
    if cfg.greso.warm_start:
        source_state(cfg)


def apply(greso, task, cfg: config_mod.Config) -> dict[str, Any] | None:
    """Start `greso` (a GresoFilter, before any record) from the source run's statistics for
    `task`'s prompts. Returns what came warm, for the run_started event; None without a source."""
    if not cfg.greso.warm_start:
        return None
    state, path = source_state(cfg)
    prompts = greso.import_history(state, task.problem_ids())
    return {"source": str(Path(cfg.greso.warm_start)), "checkpoint_step": checkpoint.step_of(path),
            "prompts": prompts, "source_prompts": len(state["traces"]),
            "p_easy": greso.p_easy, "p_hard": greso.p_hard}
