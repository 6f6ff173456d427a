"""A worker shut down mid-run (Ctrl-C on `make run`, a deploy's SIGTERM then SIGINT): the run it
was training ends `interrupted` with the reason and where a resume continues, not `failed` with
the worker's exit code."""
import os
import signal

import pytest
from conftest import _TMP, Proc, _test_db_env

from trainer import config as config_mod
from webapp.dashboard.actions.launch import enqueue
from webapp.dashboard.models import Run, RunEvent, Status

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.timeout(240)]

QUEUE = "shutdown-test"   # a queue of this test's own worker: the session's worker never takes it


def test_a_run_whose_worker_is_shut_down_ends_interrupted(user, tiny, wait_until):
    from webapp.dashboard.management.commands.serve import worker_command

    cfg = config_mod.load("demo", {**tiny, "run.max_steps": 500, "run.checkpoint_every": 1})
    run = Run.objects.create(owner=user, name="shut down", config=cfg.to_dict(), knobs=cfg.knob_values(),
                             max_steps=cfg.run.max_steps, status=Status.QUEUED, queue=QUEUE)
    enqueue(run, resume=False)
    worker = Proc("worker", worker_command(concurrency=1, queues=[QUEUE]), _test_db_env(),
                  _TMP / "shutdown-worker.log")
    try:
        wait_until(lambda: Run.objects.filter(pk=run.pk, step__gte=2).exists(), 120, "step 2")
        # Ctrl-C reaches the whole process group; a second one is Celery's cold shutdown

        os.killpg(worker.p.pid, signal.SIGINT)
        wait_until(lambda: worker.p.poll() is not None or os.killpg(worker.p.pid, signal.SIGINT), 60,
                   "the worker to exit", interval=2)
    finally:
        worker.stop()
    run.refresh_from_db()
    assert run.status == Status.INTERRUPTED, (run.status, run.error, worker.text()[-3000:])
    assert "shut down mid-run" in run.error and "resume" in run.allowed_actions
    kinds = list(RunEvent.objects.filter(run=run).values_list("kind", flat=True))
    assert "run_interrupted" in kinds and "error" not in kinds
