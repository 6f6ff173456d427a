"""Celery routing: a run goes to the queue chosen at launch, and only the workers consuming that
queue (e.g. the ones on the GPU machines of that kind) run it. Two real workers on different
queues, one tiny run per queue."""
import json
import os

import pytest
from conftest import _TMP, Proc, _test_db_env

from webapp.dashboard.models import Run


def post(client, url, data):
    return client.post(url, json.dumps(data), content_type="application/json")


@pytest.mark.django_db
def test_queue_is_validated_and_offered(alice, settings, tiny):
    base = settings.TRAINING_QUEUE
    settings.RLPILOT_QUEUES = [base, "gpu-h200"]
    r = post(alice, "/api/runs", {"name": "x", "preset": "demo", "queue": "gpu-nope"})
    assert r.status_code == 400 and "gpu-h200" in r.json()["errors"]["queue"]
    assert not Run.objects.exists()
    r = post(alice, "/api/runs", {"name": "x", "preset": "demo", "queue": "gpu-h200", "overrides": tiny})
    assert r.status_code == 201
    run = Run.objects.get()
    assert run.queue == "gpu-h200" and alice.get(f"/api/runs/{run.pk}").json()["queue"] == "gpu-h200"
    r = post(alice, "/api/runs", {"name": "y", "preset": "demo"})
    assert Run.objects.get(pk=r.json()["id"]).queue == base       # default: the first queue
    html = alice.get("/").content.decode()
    assert '<option value="gpu-h200"' in html and 'name="queue"' in html
    r = alice.post("/", {"name": "z", "preset": "demo", "queue": "nope"})
    assert r.status_code == 400 and 'data-error-for="queue"' in r.content.decode()


@pytest.mark.django_db
def test_engine_fields_in_the_launch_form(alice):
    html = alice.get("/").content.decode()
    assert 'name="cfg:rollout.engine"' in html and '<option value="sglang"' in html
    assert 'name="cfg:rollout.sglang_urls"' in html
    r = alice.post("/", {"name": "s", "preset": "demo", "cfg:rollout.engine": "sglang"})
    assert r.status_code == 400 and 'data-error-for="rollout.sglang_urls"' in r.content.decode()
    r = post(alice, "/api/runs", {"name": "s", "preset": "demo", "overrides": {"rollout.engine": "vllm"}})
    assert r.status_code == 400 and "rollout.engine" in r.json()["errors"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_runs_go_to_the_workers_of_their_queue(django_db_setup, alice, settings, tiny, wait_until):
    from webapp.dashboard.management.commands.serve import worker_command

    qa, qb = settings.TRAINING_QUEUE + "-gpu-a", settings.TRAINING_QUEUE + "-gpu-b"
    settings.RLPILOT_QUEUES = [qa, qb]
    tag = os.getpid()
    env = _test_db_env()
    workers = {q: Proc(f"worker {q}", worker_command(concurrency=1, queues=[q], name=f"w{q[-1]}-{tag}"),
                       env, _TMP / f"worker-{q}.log") for q in (qa, qb)}
    try:
        for w in workers.values():
            w.wait_for(lambda w=w: " ready." in w.text(), 90, "'ready' line")
        ids = {}
        for q in (qa, qb):
            r = post(alice, "/api/runs", {"name": f"on {q}", "preset": "demo", "queue": q,
                                          "overrides": {**tiny, "run.max_steps": 2}})
            assert r.status_code == 201, r.content
            ids[q] = r.json()["id"]
        wait_until(lambda: Run.objects.filter(pk__in=ids.values(), status__in=("finished", "failed")).count() == 2,
                   180, "both runs to finish")
        for q, rid in ids.items():
            run = Run.objects.get(pk=rid)
            assert run.status == "finished", run.error + workers[q].text()[-3000:]
            assert run.worker_host.startswith(f"w{q[-1]}-{tag}@"), (q, run.worker_host)
            assert f"[{run.celery_task_id}]" in workers[q].text() or run.celery_task_id in workers[q].text()
            other = workers[qb if q == qa else qa]
            assert run.celery_task_id not in other.text()
    finally:
        for w in workers.values():
            w.stop()
