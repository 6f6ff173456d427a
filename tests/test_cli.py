"""The command line as a user runs it (subprocesses)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.run.controls import FileControlSource

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--set", "rollout.rollout_batch_size=4", "--set", "rollout.n_samples_per_prompt=4",
        "--set", "rollout.max_response_len=64", "--set", "run.eval_every=0",
        "--set", "run.reward_workers=1"]


def cli(*args, timeout=300):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "trainer", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_run_demo_three_steps_writes_metrics_and_resumes(tmp_path):
    out = tmp_path / "run"
    p = cli("run", "demo", "--set", "run.max_steps=3", *TINY, "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "step 3/3" in p.stdout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and "reward/mean" in rows[0]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["status"] == "finished" and summary["steps"] == 3
    # the same --out again is refused rather than overwritten
    again = cli("run", "demo", "--set", "run.max_steps=3", "--out", str(out))
    assert again.returncode == 2 and "--resume" in again.stderr
    p = cli("run", "--resume", str(out), "--set", "run.max_steps=4")
    assert p.returncode == 0, p.stderr
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


def test_bad_overrides_exit_2_naming_the_key():
    p = cli("run", "demo", "--set", "optim.lr=5", "--set", "optim.nope=1")
    assert p.returncode == 2
    assert "optim.lr: got 5; expected a number in [0.0, 1.0]" in p.stderr
    assert "optim.nope: unknown key 'nope'" in p.stderr
    p = cli("run", "nosuchpreset")
    assert p.returncode == 2 and "demo" in p.stderr


def test_knobs_json_lists_the_tunable_schema():
    p = cli("knobs", "--json")
    rows = json.loads(p.stdout)
    assert all(r["tunable"] for r in rows)
    assert {"optim.lr", "async.max_staleness", "greso.alpha",
            "april.segment_max_tokens"} <= {r["name"] for r in rows}


def test_presets_say_what_an_opt_in_preset_needs():
    needs = ("opt-in: needs model.path = var/models/smollm2-135m-instruct "
             "(create it with `python -m trainer import-gguf smollm2`; docs/models.md)")
    p = cli("presets")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "demo" in lines and "all" in lines   # a preset that runs as installed: its name alone
    assert f"smollm2-math: {needs}" in lines
    p = cli("presets", "--json")
    data = json.loads(p.stdout)
    assert data["smollm2-math"]["requires"] == needs
    # resolved in the project's var/ (or RLPILOT_VAR_DIR's, which the web tests set for the session)
    assert data["smollm2-math"]["config"]["model"]["path"].endswith("models/smollm2-135m-instruct")
    assert data["demo"]["requires"] is None and data["demo"]["config"]["model"]["path"] == "builtin"


def test_control_writes_commands_the_run_reads(tmp_path):
    source = FileControlSource(tmp_path)  # makes control/
    p = cli("control", str(tmp_path), "--set", "optim.lr=5e-5", "--pause")
    assert p.returncode == 0, p.stderr
    cmds = source.poll()
    assert [c.kind for c in cmds] == ["set_knobs", "pause"]
    assert cmds[0].knobs == {"optim.lr": 5e-5}
    assert source.poll() == []  # consumed once
    p = cli("control", str(tmp_path), "--set", "model.path=/x")
    assert p.returncode == 2 and "cannot change during a run" in p.stderr
    p = cli("control", str(tmp_path / "nope"), "--stop")
    assert p.returncode == 2 and "not a run directory" in p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["april", "greso", "async", "all"])
def test_every_technique_preset_trains_from_the_cli(tmp_path, preset):
    out = tmp_path / preset
    p = cli("run", preset, "--set", "run.max_steps=2", "--set", "rollout.rollout_batch_size=4",
            "--set", "rollout.n_samples_per_prompt=4", "--set", "rollout.max_response_len=128",
            "--set", "run.eval_every=0", "--set", "model.threads=1", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    key = {"april": "april/buffer_size", "greso": "greso/p_easy",
           "async": "async/staleness/max", "all": "async/staleness/max"}[preset]
    assert key in rows[-1]
