"""What a run's checkpoint holds besides the model, and how a resumed run gets it back.

The file format (safetensors + tagged JSON, no pickle) is trainer/checkpoint.py; this module
says what of a Runner goes in: the step and policy version, the data cursor, the counters, the
best/last evaluation, the config with its knob values, the optimizer, the sampling RNG (one
stream per generation process), the rollout driver's state (APRIL's buffer, the asynchronous
queue) and GRESO's per-prompt history. Rank 0 (the controller) holds all of it: the other
training ranks hold nothing of their own (trainer/training_ranks.py).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from trainer import checkpoint
from trainer import config as config_mod


def prepare_run_dir(out: str | Path, overwrite: bool = False) -> Path:
    """An empty folder for a new run (a folder holding a run is replaced only on `overwrite`)."""
    d = Path(out)
    if d.exists() and any(d.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{d} is not empty; pass --resume {d} to continue that run, "
                                  "or choose another --out")
        shutil.rmtree(d)
    d.mkdir(parents=True, exist_ok=True)
    return d


def load_latest(run_dir: Path, cfg: config_mod.Config, keep_knobs=()):
    """(checkpoint path, state, tensors, config to resume with). Knob values changed during the
    run win over the saved config's starting values, except those the caller sets explicitly
    for the resumed run (`keep_knobs`)."""
    path = checkpoint.latest(run_dir)
    state, tensors = checkpoint.load(path)
    keep = set(keep_knobs)
    cfg = config_mod.apply_overrides(cfg, {k: v for k, v in state["knobs"].items() if k not in keep})
    return path, state, tensors, cfg


def save(runner) -> Path:
    state = {"step": runner.step, "version": runner.version, "cursor": runner.prompts.cursor,
             "totals": runner.totals, "best_eval": runner.best_eval, "last_eval": runner.last_eval,
             "config": runner.cfg.to_dict(), "knobs": runner.cfg.knob_values(),
             "ledger": runner.rollout.ledger.state_dict()}
    tensors = {"optimizer": runner.learner.state_dict(),
               "rng": checkpoint.rng_state(runner.engine.generator),
               "rollout": runner.rollout.state_dict(), "greso": runner.greso.state_dict()}
    return checkpoint.save(runner.run_dir, runner.step, model=runner.model, tokenizer=runner.tokenizer,
                           state=state, tensors=tensors, keep=runner.cfg.run.keep_checkpoints)


def restore(runner, state: dict, tensors: dict) -> None:
    runner.step, runner.version = state["step"], state["version"]
    runner.prompts.cursor = state["cursor"]
    runner.totals.update(state["totals"])
    runner.best_eval, runner.last_eval = state.get("best_eval"), state.get("last_eval")
    runner.learner.load_state_dict(tensors["optimizer"])
    checkpoint.set_rng_state(tensors["rng"], runner.engine.generator)
    runner.rollout.load_state_dict(tensors.get("rollout", {}), runner.version)
    runner.rollout.ledger.load_state_dict(state.get("ledger", {}))
    if "greso" in tensors:
        runner.greso.load_state_dict(tensors["greso"])
    runner.engine.version = runner.version
