"""A generation process that keeps dying ends the run with a cause a person can read: a real
SIGKILL loop (every process the pool starts is killed as soon as it is stepped, from step 2 on)
until the pool gives it up; the CLI prints, and the run's error event says, which process, its
signal, its restarts, the step, and where a resume continues (only with a checkpoint)."""
import json
import os
import re
import signal

import pytest
from helpers import TINY_RUN

from trainer.cli.main import main
from trainer.engine.pool import EnginePool

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

MAX_FAILURES = 3


class Loop:
    def __init__(self):
        self.armed, self.killed = False, []


def arm_kill_loop(monkeypatch) -> Loop:
    """SIGKILL every generation process the pool steps once step 1 is trained (and checkpointed,
    with run.checkpoint_every=1); the pool gives a process up after MAX_FAILURES failures in a
    row, with short back-offs. Returns the loop: `killed` holds the pids killed."""
    from trainer.run.runner import Runner

    loop = Loop()
    monkeypatch.setattr(EnginePool.__init__, "__kwdefaults__",
                        {**EnginePool.__init__.__kwdefaults__, "backoff_s": 0.05,
                         "backoff_max_s": 0.1, "max_failures": MAX_FAILURES})
    real_step, real_after = EnginePool.step, Runner._after_step

    def step(self):
        if loop.armed:
            for m in self.members:
                if m.engine is not None and m.engine.proc.pid not in loop.killed:
                    loop.killed.append(m.engine.proc.pid)
                    os.kill(m.engine.proc.pid, signal.SIGKILL)
        return real_step(self)

    def after_step(self):
        real_after(self)
        loop.armed = True

    monkeypatch.setattr(EnginePool, "step", step)
    monkeypatch.setattr(Runner, "_after_step", after_step)
    return loop


def sentence(pid: int, resume: str, step: int = 2) -> str:
    return (f"generation process 0 (pid {pid}, {MAX_FAILURES - 1} restarts) was killed by "
            f"SIGKILL (signal 9) during step {step} and was given up: "
            f"{MAX_FAILURES} failures in a row (deaths before it delivered a token, or failed "
            f"restarts) give a generation process up, and none is left; {resume}")


@pytest.mark.parametrize("preset, checkpoint_every", [("demo", 1), ("async", 0)])
def test_a_generation_process_that_keeps_dying_ends_the_run_with_a_readable_cause(
        tmp_path, capsys, monkeypatch, preset, checkpoint_every):
    kill_loop = arm_kill_loop(monkeypatch)
    out = tmp_path / "run"
    rc = main(["run", preset, "--out", str(out), *[a for s in TINY_RUN for a in ("--set", s)],
               "--set", "cluster.gen_procs=1", "--set", "run.max_steps=4",
               "--set", f"run.checkpoint_every={checkpoint_every}",
               "--set", "async.worker_threads=1"])
    err = capsys.readouterr().err
    assert rc == 1
    assert len(kill_loop.killed) == MAX_FAILURES, kill_loop.killed   # the first process, then each restart
    resume = ("resume continues from the checkpoint at step 1" if checkpoint_every
              else "no checkpoint was written: a resume starts over")
    # the step after the last one trained: asynchronous generation may have reached step 3 while
    # the trainer finished step 2
    trained = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    step = max(trained) + 1
    assert step in ((2,) if preset == "demo" else (2, 3)), trained
    line = next(x for x in err.splitlines() if x.startswith("run failed: "))
    assert line == "run failed: " + sentence(kill_loop.killed[-1], resume, step), err
    assert ("(python -m trainer run --resume" in err) == bool(checkpoint_every), err
    assert "Traceback" not in err
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    error = [e for e in events if e["kind"] == "error"]
    assert len(error) == 1 and error[0]["message"] == sentence(kill_loop.killed[-1], resume, step)
    # each death was a warning on the way, with the signal named
    died = [e["message"] for e in events if e["kind"] == "warning"
            and re.match(r"generation process 0 \(pid \d+\) died", e["message"])]
    assert len(died) == MAX_FAILURES and all("SIGKILL" in m for m in died)
