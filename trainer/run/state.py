"""What a run's checkpoint holds besides the model, and how a resumed run gets it back.

The file format (safetensors + tagged JSON, no pickle) is trainer/run/checkpoint.py; this module
says what of a Runner goes in: the step and policy version, the data cursor, the counters, the
best/last evaluation, the config with its knob values, the pilot's recent rows and the
autopilot's state, the optimizer, the sampling RNG (one
stream per generation process), the rollout driver's state (APRIL's buffer, the asynchronous
queue) and GRESO's per-prompt history. Rank 0 (the controller) holds all of it: the other
training ranks hold nothing of their own (trainer/run/training_ranks.py), except with a sharded
model, whose model and optimizer every rank writes as DCP shards (trainer/cluster/sharding.py).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from trainer import config as config_mod
from trainer.run import checkpoint


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


# What a checkpoint holds that only means something under the config it was written with: a
# resume with --set and a fork refuse to change these (carry_problems).
BOUND = {
    "model.path": "the checkpoint holds this model's weights, tokenizer and optimizer state",
    **{key: "the checkpoint holds adapters of this shape (or none) and their optimizer state"
       for key in ("lora.rank", "lora.alpha", "lora.target_modules")},
    **{key: "the data cursor and GRESO's per-prompt history index the training problems, which "
       "this key defines" for key in ("data.task", "data.path", "data.train_size",
                                      "data.max_list_len", "data.length_alpha",
                                      "data.max_operand", "run.seed")},
}
# ... and these only while the checkpoint holds rollout groups (APRIL's buffer, the async queue)
BOUND_WITH_GROUPS = {
    "rollout.n_samples_per_prompt": "they were drawn with the old group size",
    "async.enabled": "the synchronous and asynchronous drivers keep them in different forms",
}


def carry_problems(state: dict, cfg: config_mod.Config, path: Path) -> dict[str, str]:
    """{key: why} for every setting of `cfg` that the checkpoint at `path` (its state.json:
    `state`) cannot carry: what it was written with differs in a key of BOUND, or of
    BOUND_WITH_GROUPS while it holds rollout groups."""
    saved = state.get("config") or {}

    def was(key):
        section, name = key.split(".", 1)
        return (saved.get(section) or {}).get(name, cfg.get(key))

    changed = {k: was(k) for k in (*BOUND, *BOUND_WITH_GROUPS) if was(k) != cfg.get(k)}
    problems = {k: f"cannot change from {old!r} to {cfg.get(k)!r} at a checkpoint: {BOUND[k]}"
                for k, old in changed.items() if k in BOUND}
    grouped = [k for k in changed if k in BOUND_WITH_GROUPS]
    if grouped:
        n = held_groups(path)
        for k in grouped if n else ():
            problems[k] = (f"cannot change from {changed[k]!r} to {cfg.get(k)!r} at this checkpoint: "
                           f"it holds {n} rollout group{'s' if n != 1 else ''} and "
                           + BOUND_WITH_GROUPS[k])
    return problems


def held_groups(path: Path) -> int:
    """Rollout groups in the checkpoint at `path` (APRIL's partial buffer, the async queue and
    in-flight groups). Read from trainer.json as plain JSON: the tensors are not needed."""
    if (path / checkpoint.STATE_FILE).is_file():
        data = json.loads((path / checkpoint.STATE_FILE).read_text()).get("data") or {}
    else:
        data = checkpoint.read_trainer_state(path)   # the old format
    rollout = data.get("rollout") or {}
    groups = rollout.get("groups") or (rollout.get("buffer") or {}).get("groups") or []
    return len(groups)


def save(runner) -> Path:
    state = {"step": runner.step, "version": runner.version, "cursor": runner.prompts.cursor,
             "totals": runner.totals, "best_eval": runner.best_eval, "last_eval": runner.last_eval,
             "device_s": runner.device_account.seconds_now(runner.timeline.pending()),
             "config": runner.cfg.to_dict(), "knobs": runner.cfg.knob_values(),
             "ledger": runner.rollout.ledger.state_dict(),
             "pilot": runner.pilot.state_dict(runner.cfg),
             "schedule_through": runner.schedule_through,
             "invariants": runner.invariants.state_dict()}
    tensors = {"rng": checkpoint.rng_state(runner.engine.generator),
               "rollout": runner.rollout.state_dict(), "greso": runner.greso.state_dict()}
    shards = None
    if runner.sharded:   # model and optimizer: every rank's shards (trainer/cluster/sharding.py)
        def shards(folder):
            runner.ranks.save_shards(runner.learner, folder)
    else:
        tensors["optimizer"] = runner.learner.state_dict()
    return checkpoint.save(runner.run_dir, runner.step, model=runner.model, tokenizer=runner.tokenizer,
                           state=state, tensors=tensors, keep=runner.cfg.run.keep_checkpoints,
                           write_shards=shards)


def restore(runner, state: dict, tensors: dict) -> None:
    runner.step, runner.version = state["step"], state["version"]
    runner.prompts.cursor = state["cursor"]
    runner.totals.update(state["totals"])
    runner.best_eval, runner.last_eval = state.get("best_eval"), state.get("last_eval")
    runner.device_account.seconds = dict(state.get("device_s") or {})   # a checkpoint from before: counted from here
    if not runner.sharded:   # sharded: every rank takes its part (build.resume_state)
        runner.learner.load_state_dict(tensors["optimizer"])
    checkpoint.set_rng_state(tensors["rng"], runner.engine.generator)
    runner.rollout.load_state_dict(tensors.get("rollout", {}), runner.version)
    runner.rollout.ledger.load_state_dict(state.get("ledger", {}))
    runner.pilot.load_state_dict(state.get("pilot", {}))   # absent in a checkpoint before the pilot
    # async.staleness_schedule: its points up to here were applied (before the schedule, the
    # checkpoint at step N was written before the boundary after step N)
    runner.schedule_through = state.get("schedule_through", runner.step - 1)
    runner.invariants.load_state_dict(state.get("invariants", {}), runner.prompts.cursor)
    if "greso" in tensors:
        runner.greso.load_state_dict(tensors["greso"])
    runner.engine.version = runner.version
