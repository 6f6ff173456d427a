"""Forking a run from the dashboard: `POST /api/runs/<id>/fork` and the fork page make a new run,
owned by the person forking, linked to its parent and started from the parent's checkpoint copied
into its own folder; the pages link both ways; refusals name what is wrong. With the real Celery
worker: a running parent is forked, keeps running with its metrics unchanged, and the child
finishes from the fork step; in Chromium, the fork from the live page and the comparison with
both runs drawn."""
from __future__ import annotations

import hashlib
import json
import re
import shutil

import pytest
from conftest import CHROMIUM

from trainer import config as config_mod
from trainer.run import fork as fork_mod
from webapp.dashboard.actions import run_dir
from webapp.dashboard.models import MetricPoint, Run, RunEvent

LIVE = {"run.checkpoint_every": 2, "run.keep_checkpoints": 2}


@pytest.fixture(autouse=True)
def no_leftover_run_folders():
    """Run ids start again at 1 in every test's database: a folder an earlier test left under
    RLPILOT_RUNS_DIR would hold another run's checkpoints. Each test here starts without any."""
    from django.conf import settings

    for d in settings.RUNS_DIR.glob("run-*"):
        shutil.rmtree(d, ignore_errors=True)
    yield


def post(client, url, data=None):
    return client.post(url, json.dumps(data or {}), content_type="application/json")


def digest(folder) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def fake_checkpoints(run: Run, steps=(2, 4)) -> None:
    """The files of a run folder that a fork reads (config.toml; each checkpoint's state.json
    and trainer.json, the model weights as one stand-in file): for the tests without a worker."""
    from trainer.run import checkpoint

    d = run_dir(run.pk)
    d.mkdir(parents=True)
    cfg = config_mod.from_dict(run.config)
    (d / "config.toml").write_text(config_mod.to_toml(cfg))
    for step in steps:
        ck = d / "checkpoints" / f"step_{step:06d}"
        (ck / "model").mkdir(parents=True)
        (ck / "model" / "model.safetensors").write_bytes(b"weights %d" % step)
        checkpoint.write_trainer_state(ck, {"rollout": {"buffer": {"groups": []}}})
        (ck / "state.json").write_text(json.dumps({"step": step, "config": cfg.to_dict(),
                                                   "knobs": cfg.knob_values()}))


# --- without a worker: the action, the API's refusals, the pages -------------------------------------

@pytest.mark.django_db
def test_api_fork_makes_a_linked_run_with_its_own_copy(alice, user, make_run, monkeypatch,
                                                       django_capture_on_commit_callbacks):
    from webapp.celery import app

    sent = []
    monkeypatch.setattr(app, "send_task", lambda *a, **k: sent.append((a, k)))
    parent = make_run(user, "running", name="base")
    fake_checkpoints(parent)
    before = digest(run_dir(parent.pk))
    with django_capture_on_commit_callbacks(execute=True):
        r = post(alice, f"/api/runs/{parent.pk}/fork",
                 {"step": 2, "overrides": {"optim.lr": 3e-5, "run.max_steps": 50}, "name": "lower lr"})
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["parent"] == parent.pk and body["fork_step"] == 2 and body["status"] == "queued"
    child = Run.objects.get(pk=body["id"])
    assert (child.parent_id, child.fork_step, child.owner, child.name) == (parent.pk, 2, user, "lower lr")
    assert child.config["optim"]["lr"] == 3e-5 and child.max_steps == 50
    assert child.knobs["optim.lr"] == 3e-5 and child.step == 2
    # queued through the normal launch path, as a resume of its own folder
    (args, kwargs), = sent
    assert args == ("webapp.dashboard.tasks.train",) and kwargs["args"] == [child.pk]
    assert kwargs["kwargs"] == {"resume": True}
    # the child's folder: the checkpoint (hard links), its config, fork.json; the parent's untouched
    record = fork_mod.read_fork(run_dir(child.pk))
    assert record["step"] == 2 and record["parent_run"] == parent.pk
    assert record["overrides"] == {"optim.lr": 3e-5, "run.max_steps": 50}
    assert fork_mod.checkpoint_steps(run_dir(child.pk)) == [2]
    saved = json.loads((run_dir(child.pk) / "checkpoints/step_000002/state.json").read_text())
    assert saved["knobs"]["optim.lr"] == 3e-5
    assert digest(run_dir(parent.pk)) == before
    forked = RunEvent.objects.get(run=child, kind="forked")
    assert forked.data["parent"] == parent.pk and forked.data["requested_by"] == "alice"
    assert not RunEvent.objects.filter(run=parent).exclude(kind="status").exists()
    from webapp.dashboard import formatting

    assert formatting.describe_event("forked", forked.data) == (
        f"from run #{parent.pk} at step 2: optim.lr = 0.00003, run.max_steps = 50 (by alice)")
    detail = alice.get(f"/api/runs/{parent.pk}").json()
    assert detail["forks"] == [child.pk] and detail["checkpoints"] == [2, 4]
    # the parent can go: the child keeps its copy and its row
    shutil.rmtree(run_dir(parent.pk))
    parent.delete()
    child.refresh_from_db()
    assert child.parent_id is None and child.fork_step == 2
    assert (run_dir(child.pk) / "checkpoints/step_000002/model/model.safetensors").read_bytes() == b"weights 2"


@pytest.mark.django_db
def test_api_fork_refusals_name_the_problem(alice, bob, user, other_user, make_run, monkeypatch):
    parent = make_run(user, "running")
    fake_checkpoints(parent)
    url = f"/api/runs/{parent.pk}/fork"
    r = post(bob, url, {"step": 2})
    assert r.status_code == 403 and "owner or staff" in r.json()["message"]
    r = post(alice, url, {"step": 3})
    assert r.status_code == 400
    assert r.json()["errors"]["step"] == (f"run {parent.pk} has no checkpoint at step 3; "
                                          "its checkpoints are at steps 2, 4")
    assert post(alice, url, {}).json()["errors"]["step"].startswith("required")
    assert "step" in post(alice, url, {"step": "2"}).json()["errors"]
    errors = post(alice, url, {"step": 2, "overrides": {"model.path": "/elsewhere",
                                                        "data.train_size": 8}}).json()["errors"]
    assert "weights, tokenizer and optimizer state" in errors["model.path"]
    assert errors["data.train_size"].startswith("cannot change from 4096 to 8")
    errors = post(alice, url, {"step": 2, "overrides": {"optim.lr": 7}}).json()["errors"]
    assert errors["optim.lr"].startswith("got 7")
    errors = post(alice, url, {"step": 4, "overrides": {"run.max_steps": 4}}).json()["errors"]
    assert "not past the fork step 4" in errors["run.max_steps"]
    r = post(alice, url, {"step": 2, "color": "red"})
    assert r.status_code == 400 and "color" in r.json()["errors"]
    assert post(alice, url, {"step": 2, "overrides": [1]}).status_code == 400
    assert post(alice, "/api/runs/999999/fork", {"step": 2}).status_code == 404
    assert Run.objects.count() == 1   # nothing made
    # the live parent rotates the checkpoint away while it is copied: no run, no folder left
    real_link = fork_mod.os.link

    def rotate_then_link(src, dst):
        shutil.rmtree(run_dir(parent.pk) / "checkpoints" / "step_000002", ignore_errors=True)
        return real_link(src, dst)

    monkeypatch.setattr(fork_mod.os, "link", rotate_then_link)
    r = post(alice, url, {"step": 2})
    assert r.status_code == 400 and "disappeared while it was copied" in r.json()["errors"]["step"]
    assert Run.objects.count() == 1
    assert sorted(p.name for p in run_dir(parent.pk).parent.iterdir()) == [run_dir(parent.pk).name]


@pytest.mark.django_db
def test_pages_link_parent_and_forks_and_the_fork_form(alice, user, other_user, make_run, monkeypatch):
    from webapp.celery import app

    monkeypatch.setattr(app, "send_task", lambda *a, **k: None)
    parent = make_run(user, "running", name="base")
    fake_checkpoints(parent)
    # the fork page: the checkpoints there, the config fields with the parent's values
    html = alice.get(f"/runs/{parent.pk}/fork?step=4").content.decode()
    assert re.search(r'<option value="4"\s+selected>4</option>', html)
    assert '<option value="2" >2</option>' in html
    assert 'id="f-optim.lr"' in html and f'placeholder="{parent.config["optim"]["lr"]}"' in html
    engine = re.search(r'<select name="cfg:rollout.engine"[^>]*><option value="">([^<]*)</option>', html)
    assert engine.group(1) == "(parent's: embedded)"
    april = re.search(r'<select name="cfg:april.enabled"[^>]*><option value="">([^<]*)</option>', html)
    assert april.group(1) == "(parent's: false)"   # as the field takes it, not Python's False
    # a refused field comes back marked; a valid one makes the run and opens its page
    r = alice.post(f"/runs/{parent.pk}/fork", {"step": "2", "name": "", "cfg:model.path": "/x"})
    assert r.status_code == 400
    assert 'data-error-for="model.path"' in r.content.decode()
    r = alice.post(f"/runs/{parent.pk}/fork", {"step": "2", "name": "", "cfg:optim.lr": "3e-5"})
    child = Run.objects.get(parent=parent)
    assert r.status_code == 302 and r["Location"] == f"/runs/{child.pk}/"
    assert child.name == "base fork@2" and child.config["optim"]["lr"] == 3e-5
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", alice.get(f"/runs/{child.pk}/").content.decode()))
    assert f"forked from #{parent.pk} base at step 2" in text
    assert f'href="/compare/?ids={parent.pk},{child.pk}"' in alice.get(f"/runs/{child.pk}/").content.decode()
    for page in (f"/runs/{parent.pk}/", f"/runs/{parent.pk}/report/"):
        text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", alice.get(page).content.decode()))
        assert f"forks: #{child.pk} (step 2)" in text, page
    report = alice.get(f"/runs/{child.pk}/report/").content.decode()
    assert "forked from" in report
    assert f'href="/runs/{parent.pk}/fork?step=2" class="fork-from"' in alice.get(
        f"/runs/{parent.pk}/report/").content.decode()
    listing = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", alice.get("/").content.decode()))
    assert f"fork of #{parent.pk} @ 2" in listing
    # someone who may not control the parent gets no fork link and no fork page
    from django.test import Client

    c = Client()
    c.force_login(other_user)
    assert 'id="fork-link"' not in c.get(f"/runs/{parent.pk}/").content.decode()
    r = c.get(f"/runs/{parent.pk}/fork")
    assert r.status_code == 302 and r["Location"] == f"/runs/{parent.pk}/report/"


# --- the real Celery worker ------------------------------------------------------------------------

def points(run_id, step_max=None):
    qs = MetricPoint.objects.filter(run_id=run_id)
    if step_max is not None:
        qs = qs.filter(step__lte=step_max)
    return sorted(qs.values_list("step", "key", "value"), key=lambda p: (p[0], p[1], repr(p[2])))


def series(run_id, key):
    return dict(MetricPoint.objects.filter(run_id=run_id, key=key).values_list("step", "value"))


def status_of(run_id):
    return Run.objects.filter(pk=run_id).values_list("status", flat=True).first()


@pytest.mark.embedded_only
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_api_fork_of_a_running_run_with_the_real_worker(celery_worker, alice, user, tiny, wait_until):
    r = post(alice, "/api/runs", {"name": "parent", "preset": "demo",
                                  "overrides": {**tiny, **LIVE, "run.max_steps": 12}})
    pid = r.json()["id"]
    steps = wait_until(lambda: status_of(pid) == "running" and alice.get(
        f"/api/runs/{pid}").json()["checkpoints"], 180, "the parent's first checkpoint")
    n = steps[0]
    r = post(alice, f"/api/runs/{pid}/fork", {"step": n, "overrides": {"optim.lr": 3e-5, "run.max_steps": n + 3}})
    assert r.status_code == 201, r.content
    cid = r.json()["id"]
    live = Run.objects.get(pk=pid)
    assert live.status == "running" and live.step < 12   # forked while it trains
    before = points(pid, n)
    wait_until(lambda: status_of(pid) in ("finished", "failed"), 300, "the parent to finish")
    wait_until(lambda: status_of(cid) in ("finished", "failed"), 300, "the child to finish")
    parent, child = Run.objects.get(pk=pid), Run.objects.get(pk=cid)
    assert parent.status == "finished", parent.error + celery_worker.text()[-3000:]
    assert child.status == "finished", child.error + celery_worker.text()[-3000:]
    # the parent went on untouched: all its steps, its points up to the fork as they were
    assert sorted(series(pid, "reward/mean")) == list(range(1, 13)) and parent.step == 12
    assert points(pid, n) == before
    assert not RunEvent.objects.filter(run_id=pid, kind__in=("rewound", "forked")).exists()
    # the child: the parent's numbering from the fork step on, the override in every step
    assert child.step == n + 3 and sorted(series(cid, "reward/mean")) == [n + 1, n + 2, n + 3]
    assert set(series(cid, "actor/lr").values()) == {3e-5}
    assert set(series(pid, "actor/lr").values()) == {parent.config["optim"]["lr"]}
    # its first step drew what the parent's step n + 1 drew (the learning rate acts after it)
    for key in ("rollout/gen_tokens", "reward/mean", "rollout/response_len/mean"):
        assert series(cid, key)[n + 1] == series(pid, key)[n + 1], key
    kinds = list(RunEvent.objects.filter(run_id=cid).order_by("seq").values_list("kind", flat=True))
    assert kinds[:2] == ["status", "forked"] and "run_resumed" in kinds


# --- in Chromium -----------------------------------------------------------------------------------

# what the comparison's reward chart has DRAWN: per trace its name, points, first and last x
DRAWN = """() => { const gd = document.querySelector('#compare-charts [data-metric="reward/mean"]');
  return {traces: gd.data.map((t, i) => { const cd = (gd.calcdata || [])[i] || [];
            return {name: t.name, n: cd.length, first: cd.length ? cd[0].x : null,
                    last: cd.length ? cd[cd.length - 1].x : null}; }),
          shapes: (gd.layout.shapes || []).map(s => s.x0)}; }"""


def shot(page, folder, name):
    """A screenshot for a person to look at (RLPILOT_E2E_SCREENSHOT_DIR keeps them elsewhere)."""
    import os
    from pathlib import Path

    folder = Path(os.environ.get("RLPILOT_E2E_SCREENSHOT_DIR") or folder)
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / f"fork-{name}.png"), full_page=True)
    print("screenshot:", folder / f"fork-{name}.png")


@pytest.mark.embedded_only
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_browser_fork_from_the_live_page_then_the_comparison(live_asgi, django_user_model, monkeypatch,
                                                             tiny, wait_until, tmp_path):
    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing (apt-get install -y chromium)"
    from conftest import logged_in_page, submit_launch_form
    from playwright.sync_api import expect

    django_user_model.objects.create_user("fern", password="fern-pw-123")
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")   # Playwright's loop in this thread
    with logged_in_page(live_asgi, "fern", "fern-pw-123",
                        viewport={"width": 1300, "height": 900}) as (page, errors):
        page.fill("#id_name", "fork parent")
        page.evaluate("document.querySelectorAll('details.section').forEach(d => d.open = true)")
        # every checkpoint kept: the one chosen cannot be rotated away before the form is sent
        pid = submit_launch_form(page, {**{k: str(v) for k, v in tiny.items()},
                                        "run.checkpoint_every": "2", "run.keep_checkpoints": "100",
                                        "run.max_steps": "200"})
        expect(page.locator("#run-status")).to_have_text("running", timeout=120_000)
        # the live page's fork link; the form lists the checkpoints there (once there is one)
        page.click("#fork-link")
        page.wait_for_selector("#fork-form")
        for _ in range(240):
            if page.locator("#id_step option").count():
                break
            page.wait_for_timeout(500)
            page.reload()
        step = int(page.locator("#id_step option").first.get_attribute("value"))
        page.select_option("#id_step", str(step))
        page.fill("#id_name", "fork child")
        page.evaluate("document.querySelectorAll('details.section').forEach(d => d.open = true)")
        page.fill("#f-optim\\.lr", "3e-5")
        page.fill("#f-run\\.max_steps", str(step + 3))
        shot(page, tmp_path, "fork-form")
        page.click("#fork-submit")
        try:
            page.wait_for_url(re.compile(r"/runs/\d+/$"), timeout=60_000)
        except Exception:
            raise AssertionError("the fork form refused: " + "; ".join(
                page.locator(".field-error, .error").all_inner_texts())) from None
        cid = int(re.search(r"/runs/(\d+)/", page.url).group(1))
        assert cid != pid
        expect(page.locator("#forked-from")).to_have_text(
            re.compile(rf"forked from #{pid} fork parent at step {step}"))
        assert status_of(pid) == "running"   # the parent goes on
        # the parent's page lists the fork; its own Stop ends it (the worker then trains the fork)
        page.goto(f"{live_asgi}/runs/{pid}/")
        expect(page.locator("#forks")).to_contain_text(f"#{cid}")
        page.click("#btn-stop")
        wait_until(lambda: status_of(pid) in ("stopped", "finished", "failed") and
                   status_of(cid) in ("finished", "failed"), 400, "both runs to end")
        assert (status_of(pid), status_of(cid)) == ("stopped", "finished")
        last = Run.objects.get(pk=pid).step
        assert last > step
        # the comparison from the child's page: both drawn, the child from the fork step on
        page.goto(f"{live_asgi}/runs/{cid}/")
        page.click("#compare-parent")
        page.wait_for_selector("body[data-charts-drawn='1']")
        drawn = page.evaluate(DRAWN)
        parent, child = drawn["traces"]
        assert parent["name"].startswith(f"#{pid} fork parent") and (parent["n"], parent["first"],
                                                                      parent["last"]) == (last, 1, last)
        assert child["name"] == f"#{cid} fork child (fork of #{pid} @ {step})"
        assert (child["n"], child["first"], child["last"]) == (3, step + 1, step + 3)
        assert drawn["shapes"] == [step]
        shot(page, tmp_path, "compare")
    assert not errors, errors
