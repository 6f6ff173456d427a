"""run.report_to in the dashboard: the launch form's list field (rendered, validated, stored),
the tracker's link on the run page, and a real worker's run mirrored to TensorBoard like a CLI
run (the Runner builds the mirror for both)."""
import importlib.util
import json

import pytest

from webapp.dashboard import actions
from webapp.dashboard.models import Run, RunEvent

pytestmark = pytest.mark.django_db


def test_the_launch_form_has_report_to_as_a_list_of_tracker_names(alice):
    html = alice.get("/").content.decode()
    assert '<input type="text" name="cfg:run.report_to" id="f-run.report_to" value="" placeholder="(none)"' in html
    assert "names, comma-separated: <code>tensorboard</code>, <code>wandb</code>, <code>mlflow</code>" in html
    r = alice.post("/", {"name": "mirrored", "preset": "demo", "cfg:run.report_to": "tensorboard, mlflow"})
    assert r.status_code == 302, r.content.decode()[-2000:]
    assert Run.objects.get(name="mirrored").config["run"]["report_to"] == ["tensorboard", "mlflow"]


@pytest.mark.parametrize("typed, error", [
    ("tensorbored", "run.report_to: unknown name &#x27;tensorbored&#x27;"),
    ("wandb, wandb", "&#x27;wandb&#x27; is named twice"),
    ('["wandb", 3]', "item 3: expected a list of distinct names from"),
])
def test_the_launch_form_refuses_a_bad_tracker_list_naming_it(alice, typed, error):
    r = alice.post("/", {"name": "bad", "preset": "demo", "cfg:run.report_to": typed})
    html = r.content.decode()
    assert r.status_code == 400 and 'data-error-for="run.report_to"' in html
    assert error.split(": ", 1)[-1] in html
    assert 'value="' + typed.replace('"', "&quot;") + '"' in html   # what was typed is kept
    assert not Run.objects.filter(name="bad").exists()


def test_the_api_takes_report_to_as_a_json_list(alice):
    post = lambda overrides: alice.post("/api/runs", json.dumps(  # noqa: E731
        {"name": "api", "preset": "demo", "overrides": overrides}), content_type="application/json")
    r = post({"run.report_to": ["wandb"]})
    assert r.status_code == 201
    assert Run.objects.get(pk=r.json()["id"]).config["run"]["report_to"] == ["wandb"]
    r = post({"run.report_to": ["comet"]})
    assert r.status_code == 400 and "unknown name 'comet'" in r.json()["errors"]["run.report_to"]


def test_the_run_page_links_a_trackers_web_page(alice, user, make_run):
    run = make_run(user)
    html = alice.get(f"/runs/{run.pk}/").content.decode()
    assert "tracker-link" not in html
    actions.event(run.pk, 1, "tracker_started", {"tracker": "tensorboard", "url": None, "dir": "/x/tensorboard"})
    actions.event(run.pk, 1, "tracker_started", {"tracker": "wandb", "url": "https://wandb.ai/me/rlpilot/runs/abc",
                                                 "dir": "/x/wandb"})
    actions.event(run.pk, 1, "tracker_started", {"tracker": "mlflow", "url": "javascript:alert(1)"})
    html = alice.get(f"/runs/{run.pk}/").content.decode()
    assert ('<a href="https://wandb.ai/me/rlpilot/runs/abc" class="tracker-link" data-tracker="wandb" '
            'target="_blank" rel="noopener noreferrer">wandb</a>') in html
    assert html.count("tracker-link") == 1 and "javascript:alert" not in html


@pytest.mark.embedded_only
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                    reason="the tensorboard package is not installed (pip install -e '.[tensorboard]')")
def test_a_worker_run_mirrors_to_tensorboard(celery_worker, alice, tiny, wait_until):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r = alice.post("/api/runs", json.dumps({"name": "tb", "preset": "demo", "overrides": {
        **tiny, "run.max_steps": 2, "run.report_to": ["tensorboard"]}}), content_type="application/json")
    rid = r.json()["id"]
    wait_until(lambda: Run.objects.filter(pk=rid, status__in=("finished", "failed")).exists(), 120, "the run")
    run = Run.objects.get(pk=rid)
    assert run.status == "finished", run.error + celery_worker.text()[-3000:]
    started = RunEvent.objects.get(run=run, kind="tracker_started")
    assert started.data == {"tracker": "tensorboard", "url": None, "dir": str(actions.run_dir(rid) / "tensorboard")}
    assert not RunEvent.objects.filter(run=run, kind="warning").exists()
    acc = EventAccumulator(started.data["dir"], size_guidance={"scalars": 0, "histograms": 0}).Reload()
    assert [(e.step, round(e.value, 5)) for e in acc.Scalars("reward/mean")] == [
        (p.step, round(p.value, 5)) for p in run.points.filter(key="reward/mean").order_by("step")]
    assert [e.step for e in acc.Histograms("rollout/response_len")] == [1, 2]
