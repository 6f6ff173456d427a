"""How a sandboxed job is driven (trainer/sandbox/base.py, session.py), whatever its backend."""
from __future__ import annotations

import time

from trainer.sandbox.base import Job, Limits, run
from trainer.sandbox.process import ProcessSandbox


class SlowToStart(ProcessSandbox):
    """A backend whose start takes a while before the job's clock starts (a seccomp filter
    compiled on first use, a cgroup made under load)."""

    def start(self, job):
        time.sleep(0.3)
        return super().start(job)


def test_a_job_past_its_wall_limit_is_said_to_have_timed_out_however_slow_its_start():
    outcome = run(SlowToStart(), Job(("-c", "while True:\n    pass"), Limits(wall_s=0.5)))
    assert outcome.timed_out and outcome.why == "timed out after 0.5s", outcome
    assert outcome.exit_code is None
