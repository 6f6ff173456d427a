"""The periodic stale-run sweep: a run whose worker dies becomes `interrupted`, with a
heartbeat alert, within RLPILOT_HEARTBEAT_TIMEOUT_S (+ one sweep interval) of its last heartbeat,
with nobody watching: no page, API call or socket. Production: Celery beat sends
`webapp.dashboard.tasks.sweep_stale_runs` to RLPILOT_SWEEP_QUEUE, consumed by a worker of its own;
locally: `manage.py serve`'s Sweeper thread (test_web_serve.py checks serve runs it)."""
import json
import os
import signal
import sys
import time
from datetime import timedelta

import pytest
from conftest import _TMP, ROOT, Proc, _test_db_env
from django.utils import timezone

from webapp.celery import app as celery_app
from webapp.dashboard.models import Run, RunEvent
from webapp.dashboard.worker import sweep, tasks


def post(client, url, data):
    return client.post(url, json.dumps(data), content_type="application/json")


def heartbeat_alerts(run_id):
    return RunEvent.objects.filter(run_id=run_id, kind="alert", data__rule="heartbeat").count()


@pytest.mark.django_db
def test_beat_sends_the_sweep_to_its_own_queue(settings):
    entry = celery_app.conf.beat_schedule["sweep-stale-runs"]
    assert entry["task"] == settings.SWEEP_TASK == tasks.sweep_stale_runs.name
    assert settings.SWEEP_TASK in celery_app.tasks
    assert entry["schedule"] == settings.SWEEP_S <= 5
    assert entry["options"]["queue"] == settings.SWEEP_QUEUE
    # not a run queue: training workers, busy with their runs, would never take it
    assert settings.SWEEP_QUEUE not in settings.RLPILOT_QUEUES
    assert celery_app.amqp.router.route({}, settings.SWEEP_TASK)["queue"].name == settings.SWEEP_QUEUE
    assert celery_app.amqp.router.route({}, tasks.train.name)["queue"].name == settings.TRAINING_QUEUE
    assert celery_app.conf.beat_scheduler == "celery.beat:Scheduler"   # no schedule file


@pytest.mark.django_db
def test_the_beat_task_body_marks_stale_runs(user, make_run, settings):
    stale = make_run(user, "running", heartbeat_at=timezone.now() - timedelta(seconds=settings.HEARTBEAT_TIMEOUT_S + 1))
    fresh = make_run(user, "paused", heartbeat_at=timezone.now())
    queued = make_run(user, "queued")
    assert tasks.sweep_stale_runs.apply().get() == 1
    assert Run.objects.get(pk=stale.pk).status == "interrupted" and heartbeat_alerts(stale.pk) == 1
    assert Run.objects.get(pk=fresh.pk).status == "paused" and Run.objects.get(pk=queued.pk).status == "queued"
    assert tasks.sweep_stale_runs.apply().get() == 0 and heartbeat_alerts(stale.pk) == 1


@pytest.mark.django_db
def test_a_run_that_beats_again_is_not_interrupted(user, make_run, settings):
    """The sweep re-checks the heartbeat under the row lock."""
    from webapp.dashboard import actions
    from webapp.dashboard.worker import alerts

    run = make_run(user, "running", heartbeat_at=timezone.now())
    cutoff = timezone.now() - timedelta(seconds=settings.HEARTBEAT_TIMEOUT_S)
    assert not actions.interrupt_lost_run(run.pk, cutoff, sweep.LOST,
                                          alert=lambda r: alerts.heartbeat_alert(r, r.step))
    assert Run.objects.get(pk=run.pk).status == "running" and heartbeat_alerts(run.pk) == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_killed_worker_is_noticed_by_the_sweep_alone(django_db_setup, alice, settings, tiny, wait_until):
    """A real worker trains a run; SIGKILL its process group (the machine is gone); nobody opens
    anything. The embedded server's sweeper marks the run interrupted and raises the alert."""
    from webapp.dashboard.management.commands.serve import worker_command

    timeout, interval = 4.0, 0.5
    queue = settings.TRAINING_QUEUE + "-doomed"
    settings.RLPILOT_QUEUES = [settings.TRAINING_QUEUE, queue]
    settings.HEARTBEAT_TIMEOUT_S = timeout
    env = {**_test_db_env(), "RLPILOT_HEARTBEAT_TIMEOUT_S": str(timeout)}
    worker = Proc("doomed worker", worker_command(concurrency=1, queues=[queue], name=f"doomed-{os.getpid()}"),
                  env, _TMP / "worker-doomed.log")
    try:
        worker.wait_for(lambda: " ready." in worker.text(), 90, "'ready' line")
        r = post(alice, "/api/runs", {"name": "doomed", "preset": "demo", "queue": queue,
                                      "overrides": {**tiny, "run.max_steps": 5000}})
        assert r.status_code == 201, r.content
        rid = r.json()["id"]
        wait_until(lambda: Run.objects.filter(pk=rid, status="running", step__gte=2).exists(), 120,
                   "the run to train a few steps")
        # no page, API call or socket from here on: only the database, read directly
        os.killpg(worker.p.pid, signal.SIGKILL)
        worker.p.wait(10)
        killed = time.monotonic()
        assert Run.objects.get(pk=rid).status == "running"   # nobody noticed (no lazy check)
        sweeper = sweep.Sweeper(interval).start()
        try:
            wait_until(lambda: Run.objects.filter(pk=rid, status="interrupted").exists(),
                       timeout + 20, "the sweep to mark the run interrupted")
            noticed = time.monotonic() - killed
        finally:
            sweeper.stop()
        # heartbeats every RLPILOT_HEARTBEAT_S (1 s here): the last one came at most ~1 s before
        # the kill, so the run is interrupted between timeout - 1 s and timeout + interval after it
        assert timeout - settings.HEARTBEAT_S - 0.5 <= noticed <= timeout + interval + 3.0, noticed
        assert sweeper.marked == 1
        run = Run.objects.get(pk=rid)
        assert run.error.startswith("heartbeat lost") and run.finished_at
        assert "heartbeat" in run.alerts["active"] and heartbeat_alerts(rid) == 1
        status = RunEvent.objects.filter(run_id=rid, kind="status").order_by("-seq").first()
        assert status.data["status"] == "interrupted" and status.data["previous"] == "running"
    finally:
        worker.stop()


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_celery_beat_and_the_sweep_worker(django_db_setup, user, make_run, settings, wait_until):
    """The production path: `celery -A webapp beat` sends the sweep every RLPILOT_SWEEP_S to
    RLPILOT_SWEEP_QUEUE, and a worker consuming only that queue runs it."""
    from webapp.dashboard.management.commands.serve import worker_command

    timeout = 3.0
    sweep_queue = f"sweep-test-{os.getpid()}"
    env = {**_test_db_env(), "RLPILOT_HEARTBEAT_TIMEOUT_S": str(timeout), "RLPILOT_SWEEP_S": "0.5",
           "RLPILOT_SWEEP_QUEUE": sweep_queue}
    settings.HEARTBEAT_TIMEOUT_S = timeout
    sweeper = Proc("sweep worker", worker_command(concurrency=1, queues=[sweep_queue], name=f"sweep-{os.getpid()}"),
                   env, _TMP / "worker-sweep.log")
    beat = Proc("beat", [sys.executable, "-m", "celery", "-A", "webapp", "beat", "-l", "info",
                         "--max-interval", "1"], env, _TMP / "beat.log")
    try:
        sweeper.wait_for(lambda: " ready." in sweeper.text(), 90, "'ready' line")
        beat.wait_for(lambda: "beat: Starting" in beat.text(), 60, "'Starting' line")
        run = make_run(user, "running", heartbeat_at=timezone.now())   # beats, then its worker dies
        wait_until(lambda: Run.objects.filter(pk=run.pk, status="interrupted").exists(), timeout + 30,
                   "beat's sweep to mark the run interrupted")
        assert heartbeat_alerts(run.pk) == 1
        assert "webapp.dashboard.tasks.sweep_stale_runs" in sweeper.text()
        assert not (ROOT / "celerybeat-schedule").exists()
    finally:
        beat.stop()
        sweeper.stop()
