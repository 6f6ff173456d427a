"""`python -m trainer run --fork RUN_DIR --from-step N`: a new run from a finished CLI run's
checkpoint at step N. Its first step trains on exactly what the parent's step N + 1 drew (the
same prompts, APRIL buffer and samples), overrides show in its config and metrics, the parent's
files are byte for byte what they were, and what a checkpoint cannot carry is refused by name."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer import config as C
from trainer.cli.samples import load as load_samples
from trainer.run import checkpoint, fork

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# APRIL on: the checkpoints hold a partial-rollout buffer the child must take over; every group
# recorded (run.log_samples = 64), so the samples files say exactly what each step drew; parked
# caches recomputed at each update (engine.kv_on_update), so a child resumed from a checkpoint,
# which holds no cache, draws exactly what the parent drew
PARENT = ["engine.kv_on_update=recompute", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
          "rollout.max_response_len=96", "rollout.max_slots=12", "run.eval_every=0",
          "run.reward_workers=0", "model.threads=1", "april.enabled=true",
          "april.segment_max_tokens=16", "run.checkpoint_every=2", "run.keep_checkpoints=5",
          "run.log_samples=64", "run.max_steps=4"]


def cli(*args):
    p = subprocess.run([sys.executable, "-m", "trainer", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    return p


def sets(pairs):
    return [x for s in pairs for x in ("--set", s)]


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def metrics(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def drawn(run_dir: Path, step: int) -> list[tuple]:
    """What a step trained on, as its samples file records it: (draw, member, prompt, completion,
    reward, version segments, trained), in order."""
    return [(r["group"], r["index"], r["prompt"], r["completion"], r["reward"], r["segments"],
             r["trained"]) for r in load_samples(run_dir) if r["step"] == step]


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    out = tmp_path_factory.mktemp("fork") / "parent"
    p = cli("run", "demo", *sets(PARENT), "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert fork.checkpoint_steps(out) == [2, 4]
    assert checkpoint.load(out / "checkpoints" / "step_000002")[1]["rollout"]["buffer"]["groups"], \
        "the parent's checkpoint at step 2 should hold APRIL's partial groups"
    return out, tree_digest(out)


def test_the_child_continues_exactly_where_the_parent_was_and_the_parent_is_untouched(parent, tmp_path):
    out, before = parent
    child = tmp_path / "child"
    # run.max_steps changes nothing about the draw: steps 3 and 4 must be the parent's
    p = cli("run", "--fork", str(out), "--from-step", "2", "--set", "run.max_steps=5",
            "--out", str(child))
    assert p.returncode == 0, p.stderr
    assert f"forked {out} at step 2 into {child}" in p.stdout
    assert tree_digest(out) == before   # the parent's files, byte for byte
    record = fork.read_fork(child)
    assert record["parent"] == str(out.resolve()) and record["step"] == 2
    assert record["overrides"] == {"run.max_steps": 5}
    assert C.loads_toml((child / "config.toml").read_text()).run.max_steps == 5
    mine, theirs = metrics(child), metrics(out)
    assert sorted(mine) == [3, 4, 5]   # the parent's numbering goes on
    for step in (3, 4):
        assert drawn(child, step) == drawn(out, step) and drawn(child, step)
        for key in ("reward/mean", "rollout/gen_tokens", "rollout/trained_tokens",
                    "april/buffer_size", "april/buffer_tokens", "train/policy_version"):
            assert mine[step][key] == theirs[step][key], (step, key)
    # at step 4 the child's state is the parent's: weights, optimizer, buffer
    _, a = checkpoint.load(out / "checkpoints" / "step_000004")
    _, b = checkpoint.load(child / "checkpoints" / "step_000004")
    assert torch.equal(a["optimizer"]["state"][0]["exp_avg"], b["optimizer"]["state"][0]["exp_avg"])
    assert _no_ids(a["rollout"]) == _no_ids(b["rollout"])
    events = [json.loads(x) for x in (child / "events.jsonl").read_text().splitlines()]
    assert events[0]["kind"] == "run_resumed" and events[0]["step"] == 2


def test_overrides_win_over_the_knobs_the_checkpoint_saved(parent, tmp_path):
    out, before = parent
    child = tmp_path / "lr"
    p = cli("run", "--fork", str(out), "--from-step", "2", "--set", "optim.lr=3e-5",
            "--set", "april.segment_max_tokens=24", "--set", "run.max_steps=3", "--out", str(child))
    assert p.returncode == 0, p.stderr
    cfg = C.loads_toml((child / "config.toml").read_text())
    assert (cfg.optim.lr, cfg.april.segment_max_tokens) == (3e-5, 24)
    parent_lr = C.loads_toml((out / "config.toml").read_text()).optim.lr
    assert parent_lr != 3e-5
    step3 = metrics(child)[3]
    assert step3["actor/lr"] == 3e-5 and metrics(out)[3]["actor/lr"] == parent_lr
    assert step3["april/segment_max_tokens"] == 24 and metrics(out)[3]["april/segment_max_tokens"] == 16
    # the child's own checkpoint at 2 says so too: a later --resume of the child keeps them
    state = json.loads((child / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["knobs"]["optim.lr"] == 3e-5 and state["config"]["optim"]["lr"] == 3e-5
    parents = json.loads((out / "checkpoints" / "step_000002" / "state.json").read_text())
    assert parents["knobs"]["optim.lr"] == parent_lr
    assert tree_digest(out) == before


def test_refusals_name_what_is_wrong(parent, tmp_path):
    out, before = parent

    def refused(*args):
        p = cli("run", *args, "--out", str(tmp_path / "refused"))
        assert p.returncode == 2, p.stdout
        assert not (tmp_path / "refused").exists()   # nothing made
        return p.stderr

    assert "is not a directory: no such run" in refused("--fork", str(tmp_path / "nope"), "--from-step", "2")
    (tmp_path / "empty").mkdir()
    assert "has no config.toml: not a run directory" in refused("--fork", str(tmp_path / "empty"),
                                                                "--from-step", "2")
    assert "no checkpoint at step 3; its checkpoints are at steps 2, 4" in refused(
        "--fork", str(out), "--from-step", "3")
    assert "--fork: give both --fork RUN_DIR and --from-step N" in refused("--fork", str(out))
    err = refused("--fork", str(out), "--from-step", "2", "--set", "model.path=/somewhere/else",
                  "--set", "data.train_size=8")
    assert "model.path: cannot change from 'builtin' to '/somewhere/else'" in err
    assert "weights, tokenizer and optimizer state" in err
    assert "data.train_size: cannot change from 4096 to 8" in err
    err = refused("--fork", str(out), "--from-step", "2", "--set", "rollout.n_samples_per_prompt=8")
    assert "rollout.n_samples_per_prompt: cannot change from 4 to 8 at this checkpoint: it holds" in err
    assert "run.max_steps: 2 is not past the fork step 2" in refused(
        "--fork", str(out), "--from-step", "2", "--set", "run.max_steps=2")
    assert "optim.lr: got 5" in refused("--fork", str(out), "--from-step", "2", "--set", "optim.lr=5")
    # what a fork refuses, a resume with --set refuses too (one check)
    p = cli("run", "--resume", str(out), "--set", "model.path=/somewhere/else")
    assert p.returncode == 2 and "model.path: cannot change" in p.stderr
    assert tree_digest(out) == before


def test_a_checkpoint_without_groups_lets_the_group_size_change(parent, tmp_path):
    out, _ = parent
    ck = out / "checkpoints" / "step_000002"
    state = json.loads((ck / "state.json").read_text())
    from trainer.run import state as run_state

    cfg = C.apply_overrides(C.loads_toml((out / "config.toml").read_text()),
                            {"rollout.n_samples_per_prompt": 8})
    assert "rollout.n_samples_per_prompt" in run_state.carry_problems(state, cfg, ck)
    empty = tmp_path / "ck"
    empty.mkdir()
    checkpoint.write_trainer_state(empty, {"rollout": {"buffer": {"groups": []}}})
    assert run_state.carry_problems(state, cfg, empty) == {}


def _no_ids(rollout_state):
    for g in rollout_state["buffer"]["groups"]:
        for s in g["samples"]:
            s.pop("request_id")
    return rollout_state


def test_a_live_parent_half_written_or_rotated_checkpoint(parent, tmp_path, monkeypatch):
    out, _ = parent
    live = tmp_path / "live"
    shutil.copytree(out, live)
    # a checkpoint being written (checkpoint.save's temporary folder) is not there yet
    half = live / "checkpoints" / ".tmp-step_000006"
    half.mkdir()
    (half / "trainer.json").write_text("{")
    assert fork.checkpoint_steps(live) == [2, 4]
    with pytest.raises(C.ConfigError) as e:
        fork.fork_run_dir(live, 6, tmp_path / "early")
    assert "no checkpoint at step 6; its checkpoints are at steps 2, 4" in str(e.value)
    # the running parent deletes the checkpoint while it is copied: said so, no half copy left
    real_link = os.link

    def rotate_then_link(src, dst):
        shutil.rmtree(live / "checkpoints" / "step_000002", ignore_errors=True)
        return real_link(src, dst)

    monkeypatch.setattr(fork.os, "link", rotate_then_link)
    with pytest.raises(C.ConfigError) as e:
        fork.fork_run_dir(live, 2, tmp_path / "late")
    assert "disappeared while it was copied" in str(e.value) and "keep_checkpoints" in str(e.value)
    assert not (tmp_path / "late" / "checkpoints").exists()


def test_knobs_changed_during_the_parent_carry_over_unless_overridden(parent, tmp_path):
    from trainer.run import state as run_state

    out, _ = parent
    changed = tmp_path / "changed"
    shutil.copytree(out, changed)
    saved = changed / "checkpoints" / "step_000002" / "state.json"
    state = json.loads(saved.read_text())   # as if a person had changed two knobs before step 2
    state["knobs"].update({"rollout.temperature": 0.7, "optim.lr": 5e-5})
    saved.write_text(json.dumps(state))
    child = fork.fork_run_dir(changed, 2, tmp_path / "child", ["optim.lr=3e-5"])
    cfg = C.loads_toml((child / "config.toml").read_text())
    _, _, _, resumed = run_state.load_latest(child, cfg)   # what a resume of the child trains with
    assert resumed.rollout.temperature == 0.7   # the parent's value at step 2
    assert resumed.optim.lr == 3e-5             # the override, not the parent's 5e-5
