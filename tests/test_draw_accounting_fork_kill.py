"""The data accounting (trainer/invariants/draws.py) on a fork and on a worker killed mid-run:
the child of a fork and a run resumed from the last checkpoint before a SIGKILL draw on from the
checkpoint's data cursor, and nothing is counted skipped or repeated. Positions the killed worker
drew after its last checkpoint were never scored in the resumed run's history (the checkpoint
does not know them), so drawing them again is no repeat."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer import config as C
from trainer.observe.metrics import MemorySink
from trainer.run import checkpoint, fork
from trainer.run.runner import Runner

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TINY = ["rollout.n_samples_per_prompt=4", "rollout.max_response_len=32", "rollout.max_slots=16",
        "run.reward_workers=0", "model.threads=1", "run.eval_every=0", "run.log_samples=0",
        "run.checkpoint_every=1", "rollout.rollout_batch_size=4"]
APRIL = ["april.enabled=true", "april.segment_max_tokens=4", "april.max_version_span=2",
         "greso.enabled=true"]


def accounting(sink: MemorySink) -> tuple[float, float, int]:
    """(prompts skipped, prompts repeated, steps the accounting reported)."""
    skipped = sink.series("invariants/prompts_skipped")
    return sum(skipped), sum(sink.series("invariants/prompts_repeated")), len(skipped)


def broken(sink: MemorySink) -> list[dict]:
    return [e for e in sink.events if e["kind"] == "invariant_violated"]


def cursor_at(ckpt: Path) -> int:
    return json.loads((ckpt / "state.json").read_text())["cursor"]


def test_a_fork_draws_on_from_the_parents_cursor_and_skips_nothing(tmp_path):
    parent = tmp_path / "parent"
    with Runner(C.load("demo", TINY + APRIL + ["run.max_steps=2"]), parent, sink=MemorySink()) as r:
        r.run()
    source = fork.find_checkpoint(parent, 1)
    at_fork = cursor_at(source)
    assert checkpoint.load(source)[1]["rollout"]["buffer"]["groups"], \
        "APRIL held partial groups across the checkpoint the child starts from"
    child = fork.fork_run_dir(parent, 1, tmp_path / "child",
                              ["run.max_steps=4", "rollout.rollout_batch_size=2"])
    sink = MemorySink()
    cfg = C.loads_toml((child / "config.toml").read_text())
    with Runner(cfg, child, sink=sink, resume=True) as r:
        assert (r.step, r.prompts.cursor) == (1, at_fork), "the child starts at the parent's checkpoint"
        r.run()
        assert r.step == 4 and r.prompts.cursor > at_fork, "the child drew on"
    assert accounting(sink) == (0, 0, 3)
    assert not broken(sink)


# the worker: a run whose every drawn position goes to a file (flushed) before it is used
WORKER = """
import sys
from pathlib import Path
from trainer import config as C
from trainer.rollout import base
from trainer.run.runner import Runner
run_dir, preset, *overrides = sys.argv[1:]
log = open(Path(run_dir).parent / "drawn.txt", "a", buffering=1)
real = base.PromptSource.next
def next(self):
    draw, problem = real(self)
    log.write(f"{draw}\\n")
    return draw, problem
base.PromptSource.next = next
with Runner(C.load(preset, overrides), run_dir, system_telemetry=False) as r:
    r.run()
"""


def drawn(tmp_path: Path) -> list[int]:
    path = tmp_path / "drawn.txt"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def kill_after_a_checkpoint(tmp_path: Path, run_dir: Path, preset: str, overrides: list[str],
                            after_step: int = 2, timeout_s: float = 120) -> Path:
    """Run a worker until a checkpoint at `after_step` or later exists and the worker has drawn
    past that checkpoint's cursor, then SIGKILL it; the last checkpoint (it is paused while
    this is judged, so the checkpoint cannot move on under the check)."""
    p = subprocess.Popen([sys.executable, "-c", WORKER, str(run_dir), preset, *overrides],
                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            assert p.poll() is None, f"the worker ended before it was killed: {p.stderr.read().decode()}"
            assert time.monotonic() < deadline, "no checkpoint to kill after"
            if (checkpoint.latest_step(run_dir) or 0) >= after_step:
                os.kill(p.pid, signal.SIGSTOP)
                last = checkpoint.latest(run_dir)
                if max(drawn(tmp_path), default=-1) >= cursor_at(last):
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait()
                    return last
                os.kill(p.pid, signal.SIGCONT)
            time.sleep(0.05)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stderr.close()


@pytest.mark.parametrize("preset,extra", [("demo", APRIL), ("async", [])])
def test_a_killed_worker_resumed_from_its_last_checkpoint_skips_and_repeats_nothing(
        tmp_path, preset, extra):
    run_dir = tmp_path / "run"
    overrides = TINY + extra + ["run.max_steps=12"]
    last = kill_after_a_checkpoint(tmp_path, run_dir, preset, overrides)
    step, cursor = checkpoint.step_of(last), cursor_at(last)
    lost = [d for d in drawn(tmp_path) if d >= cursor]
    assert lost, "the killed worker drew positions after its last checkpoint"
    sink = MemorySink()
    cfg = C.load(preset, overrides + [f"run.max_steps={step + 3}"])
    with Runner(cfg, run_dir, sink=sink, resume=True, keep_knobs=("run.max_steps",),
                system_telemetry=False) as r:
        assert (r.step, r.prompts.cursor) == (step, cursor)
        r.run()
        assert r.step == step + 3
        assert r.prompts.cursor > max(lost), "the positions drawn after the checkpoint are drawn again"
    assert accounting(sink) == (0, 0, 3)
    assert not broken(sink)
