"""Past-run reports, comparison, exports, notes/tags/archive/delete, checkpoints, alerts."""
import csv
import io
import json
import math
import shutil

import pytest
from helpers import NoBell

from trainer import config as config_mod
from trainer.models.loading import builtin_dir
from webapp.dashboard import actions
from webapp.dashboard.actions import Record
from webapp.dashboard.models import MetricPoint, Run, RunEvent, Status
from webapp.dashboard.reports import comparison, exports, summary
from webapp.dashboard.worker import sweep
from webapp.dashboard.worker.telemetry import DbSink

pytestmark = pytest.mark.django_db

EVIL = '<script>alert("x")</script>'
ESCAPED = "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;"


def fill(run, steps=6, **extra):
    """Synthetic rows like the trainer's: scalars per step, a histogram, a knob change."""
    recs = []
    for s in range(1, steps + 1):
        recs.append(Record("points", s, "", {
            "reward/mean": 0.1 * s, "reward/accuracy": 0.05 * s, "actor/kl": 0.001 * s,
            "actor/pg_loss": 0.5 - 0.01 * s, "perf/gen_tokens_per_s": 100.0 + s,
            "perf/trained_tokens_per_s": 50.0 + s, "rollout/gen_tokens": 200, "rollout/trained_tokens": 100,
            "rollout/samples": 16, "train/gen_tokens_total": 200 * s, "train/trained_tokens_total": 100 * s,
            "train/samples_total": 16 * s, "timing/gen_s": 0.5, "timing/reward_s": 0.1, "timing/train_s": 0.3,
            "timing/weight_sync_s": 0.1, "timing/step_s": 1.0, "system/cpu_util": 50.0,
            "greso/prompts_sampled": 5, "greso/skip_rate": 0.2, **extra}))
        recs.append(Record("histogram", s, "rollout/response_len", {"edges": [0, 8, 16], "counts": [3, s]}))
    recs.append(Record("event", 3, "knob_applied", {"change_id": "c1", "requested_by": "alice",
                                                    "changes": {"optim.lr": {"old": 1e-5, "new": 2e-5}}}))
    actions.append(run.pk, recs, {"step": steps})
    run.refresh_from_db()
    return run


# --- report page ---------------------------------------------------------------------------------

@pytest.mark.parametrize("status", [s.value for s in Status])
@pytest.mark.parametrize("with_metrics", [True, False])
def test_report_renders_for_every_status(alice, user, make_run, status, with_metrics):
    run = make_run(user, status, name=EVIL, note=EVIL + "\nsecond line", tags=[EVIL, "april"])
    if with_metrics:
        fill(run)
    r = alice.get(f"/runs/{run.pk}/report/")
    assert r.status_code == 200
    html = r.content.decode()
    assert EVIL not in html and ESCAPED in html
    assert 'id="charts"' in html and "dashboard/charts.js" in html and 'id="config-toml"' in html
    if with_metrics:
        assert 'data-key="trained_tokens"' in html and "600" in html   # 100 * 6 trained tokens
        assert "optim.lr" in html and "alice" in html                    # the knob timeline
        assert 'data-key="time_gen_pct"' in html
    else:
        assert "No metrics were recorded" in html
    # the live page links to it and shows the run too
    assert alice.get(f"/runs/{run.pk}/").status_code == 200


def test_summary_figures(user, make_run):
    run = fill(make_run(user, "finished"))
    s = summary.summary(run)
    assert s["steps"] == 6 and s["trained_tokens"] == 600 and s["gen_tokens"] == 1200
    assert s["samples_generated"] == 96
    assert s["samples_skipped"] == round(6 * 5 * 0.2 * 4)        # prompts skipped x samples/prompt
    assert s["accuracy_final"] == pytest.approx(0.3) and s["accuracy_best"] == pytest.approx(0.3)
    assert s["reward_final"] == pytest.approx(0.6)
    assert s["trained_tokens_per_s"] == pytest.approx(53.5)
    assert s["time_gen_pct"] == pytest.approx(50.0) and s["time_train_pct"] == pytest.approx(30.0)
    assert s["cpu_util"] == pytest.approx(50.0) and s["gpu_util"] is None
    empty = summary.summary(make_run(user, "failed"))
    assert empty["trained_tokens"] is None and empty["time_gen_pct"] is None


def test_summary_says_where_the_generated_tokens_went(alice, user, make_run):
    from webapp.dashboard import actions
    from webapp.dashboard.actions import Record

    run = make_run(user, "finished")
    steps = [  # per step: generated, trained, waiting after it, dropped by reason
        (100, 40, 20, {"zero_variance": 30, "version_span": 10}),
        (80, 50, 10, {"zero_variance": 30, "surplus": 10}),    # 10 of the waiting were trained
    ]
    gen_total = trained_total = 0
    for i, (gen, trained, waiting, dropped) in enumerate(steps, start=1):
        gen_total, trained_total = gen_total + gen, trained_total + trained
        values = {"rollout/tokens/generated": gen, "rollout/tokens/trained": trained,
                  "rollout/tokens/waiting": waiting, "rollout/tokens/generated_total": gen_total,
                  "rollout/tokens/trained_total": trained_total,
                  **{f"rollout/waste/{r}": dropped.get(r, 0) for r in
                     ("version_span", "stale", "zero_variance", "surplus", "aborted")}}
        actions.append(run.pk, [Record("points", i, "", values)], {"step": i})
    s = summary.summary(run)
    assert (s["waste_zero_variance"], s["waste_version_span"], s["waste_surplus"]) == (60, 10, 10)
    assert s["waste_stale"] == 0 and s["ledger_waiting"] == 10
    # the parts add up: 180 generated = 90 trained + 10 waiting + 80 dropped
    assert 90 + s["ledger_waiting"] + sum(s[f"waste_{r}"] for r in
                                          ("version_span", "stale", "zero_variance", "surplus", "aborted")) == 180
    assert s["trained_token_share"] == pytest.approx(90 / 180)
    html = alice.get(f"/runs/{run.pk}/report/").content.decode()
    assert "generated tokens dropped: zero-variance groups" in html


def test_an_ended_runs_alerts_are_titled_as_history(alice, user, make_run):
    alerts = {"active": {"kl_rising": {"step": 14, "message": "KL is rising"}}}
    live = make_run(user, "running", alerts=alerts)
    ended = make_run(user, "stopped", alerts=alerts)
    for run, title in ((live, ">Alerts<"), (ended, ">Alerts active when the run ended<")):
        for url in (f"/runs/{run.pk}/", f"/runs/{run.pk}/report/"):
            html = alice.get(url).content.decode()
            assert title in html and "kl_rising (step 14): KL is rising" in html, url


def test_wall_time_counts_only_the_time_spent_running(user, make_run):
    """queued 10 s, running 20 s, paused 10 s, running 10 s, stopped for a day, queued 10 s,
    running 20 s: 50 s, what a run that went straight through would show."""
    from datetime import timedelta

    from webapp.dashboard import actions
    from webapp.dashboard.models import RunEvent

    run = make_run(user, "queued")
    t0 = RunEvent.objects.get(run=run).time
    for at, status in ((10, "running"), (30, "paused"), (40, "running"), (50, "stopping"),
                       (50, "stopped"), (86_450, "queued"), (86_460, "running"), (86_480, "stopped")):
        seq = actions.event(run.pk, 1, "status", {"status": status})
        RunEvent.objects.filter(run=run, seq=seq).update(time=t0 + timedelta(seconds=at))
    run.refresh_from_db()
    assert summary.summary(run)["wall_time_s"] == pytest.approx(50.0)
    assert summary.summary(make_run(user, "queued"))["wall_time_s"] is None   # never ran


# --- comparison ----------------------------------------------------------------------------------

def test_compare_page(alice, user, other_user, make_run):
    a = fill(make_run(user, "finished", name="sync"))
    b = make_run(other_user, "finished", name=EVIL)
    cfg = dict(b.config)
    cfg["april"] = {**cfg["april"], "enabled": not cfg["april"]["enabled"]}
    Run.objects.filter(pk=b.pk).update(config=cfg)
    fill(b)
    MetricPoint.objects.filter(run=b, key="perf/trained_tokens_per_s").update(value=53.5 * 1.42)
    c = make_run(user, "interrupted", name="empty")   # a run with no metrics
    r = alice.get(f"/compare/?ids={a.pk},{b.pk}&ids={c.pk}")
    assert r.status_code == 200
    html = r.content.decode()
    assert EVIL not in html and ESCAPED in html
    assert "1.42x trained tokens/s (mean)" in html
    diff = comparison.config_diff([a, Run.objects.get(pk=b.pk)])
    assert [d["key"] for d in diff] == ["april.enabled"]
    assert 'data-key="april.enabled"' in html and 'data-key="run.max_steps"' not in html
    # 2 to 8 runs
    assert alice.get(f"/compare/?ids={a.pk}").status_code == 302
    assert alice.get("/compare/?ids=" + ",".join(str(a.pk + i) for i in range(9))).status_code == 302
    assert alice.get(f"/compare/?ids={a.pk},999999").status_code == 404
    # the runs list offers the checkboxes
    assert 'form="compare-form"' in alice.get("/").content.decode()


def test_compare_page_carries_each_runs_mismatch_band(alice, user, make_run):
    """compare.js draws each run's band on the |Δ log p| chart: the page names each run's current
    mismatch.lower / upper (its knobs, else its config; nothing for a run from before the section)
    and embeds the chart list (which says which metric a band goes with)."""
    import json
    import re

    a, b, old = make_run(user, "finished"), make_run(user, "finished"), make_run(user, "finished")
    Run.objects.filter(pk=b.pk).update(knobs={**b.knobs, "mismatch.upper": 4.0})
    cfg = {k: v for k, v in old.config.items() if k != "mismatch"}
    Run.objects.filter(pk=old.pk).update(config=cfg, knobs={k: v for k, v in old.knobs.items()
                                                           if not k.startswith("mismatch.")})
    html = alice.get(f"/compare/?ids={a.pk},{b.pk},{old.pk}").content.decode()
    page = json.loads(re.search(r'<script id="compare-page" type="application/json">(.*?)</script>', html).group(1))
    assert [r["mismatch"] for r in page["runs"]] == [{"lower": 0.5, "upper": 2.0}, {"lower": 0.5, "upper": 4.0}, {}]
    specs = json.loads(re.search(r'<script id="chart-specs" type="application/json">(.*?)</script>', html).group(1))
    band = [c for c in specs["charts"] if c.get("band")]
    # the engine's own (age 0), and all tokens' where a run has no age split (its fallback)
    assert [(c["keys"][1], c["fallback"]["keys"][1]) for c in band] == [
        ("mismatch/age0/abs_logp_diff_max", "mismatch/abs_logp_diff_max")]


# --- exports -------------------------------------------------------------------------------------

def test_exports_round_trip(alice, user, make_run, tmp_path):
    run = fill(make_run(user, "finished", name=EVIL), steps=30)
    actions.append(run.pk, [Record("points", 31, "", {"actor/pg_loss": float("nan"), "x/inf": "inf"})])
    written = sorted((p.seq, p.step, p.key, p.value) for p in MetricPoint.objects.filter(run=run))
    assert len(written) == 30 * 20 + 2

    r = alice.get(f"/api/runs/{run.pk}/export?format=csv")
    assert r.status_code == 200 and r["Content-Type"].startswith("text/csv")
    assert "attachment" in r["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(r.content.decode())))
    got = sorted((int(x["seq"]), int(x["step"]), x["key"], float(x["value"]) if x["value"] else None) for x in rows)
    assert got == written

    data = alice.get(f"/api/runs/{run.pk}/export?format=json").json()
    got = sorted((s, k, v) for k, ser in data["metrics"].items() for s, v in zip(ser["steps"], ser["values"]))
    assert got == sorted((s, k, v) for _, s, k, v in written)
    assert len(data["histograms"]) == 30 and data["run"]["name"] == EVIL
    assert data["summary"]["trained_tokens"] == 3000 and data["knob_timeline"][0]["key"] == "optim.lr"

    toml = alice.get(f"/api/runs/{run.pk}/export?format=toml").content.decode()
    assert config_mod.loads_toml(toml).to_dict() == run.config

    html = alice.get(f"/api/runs/{run.pk}/export?format=html").content.decode()
    assert "Plotly" in html and 'id="report-data"' in html and EVIL not in html
    assert "<script src=" not in html and "http://" not in html.split("<script>")[0]

    assert alice.get(f"/api/runs/{run.pk}/export?format=xml").status_code == 400
    assert alice.get("/api/runs/999999/export?format=csv").status_code == 404

    from django.core.management import call_command

    out = tmp_path / "r.html"
    call_command("export_run", str(run.pk), "--format", "html", "-o", str(out))
    assert out.read_text().startswith("<!doctype html>")
    call_command("export_run", str(run.pk), "--format", "csv", "-o", str(tmp_path / "r.csv"))
    assert len((tmp_path / "r.csv").read_text().splitlines()) == len(written) + 1


@pytest.mark.slow
@pytest.mark.embedded_only
def test_html_report_opens_offline_in_chromium(user, make_run, tmp_path, monkeypatch):
    from conftest import CHROMIUM, browser_page

    assert shutil.which(CHROMIUM)
    gpu = {"system/gpu_util": 80.0, "system/gpu_mem_gb": 40.0, "system/gpu_power_w": 500.0,
           **{f"system/gpu{i}/{m}": 10.0 * i for i in range(2) for m in ("util", "mem_gb", "power_w")}}
    run = fill(make_run(user, "finished", name=EVIL), steps=20, **gpu)
    path = tmp_path / "report.html"
    path.write_text(exports.export_html(run))
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    blocked = []
    with browser_page() as (page, errors):
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file://")
                   else (blocked.append(route.request.url), route.abort()))
        page.goto(path.as_uri())
        page.wait_for_selector("body[data-charts-drawn='1']", timeout=30_000)
        assert page.locator("#chart-reward .main-svg").count() >= 1
        assert int(page.locator("#chart-reward").get_attribute("data-npoints")) == 40
        assert page.locator("#chart-len-heat .main-svg").count() >= 1
        assert page.locator("#run-name").inner_text() == EVIL
        # GPU telemetry: the mean over devices, and one trace per device
        assert "GPU utilisation" in page.locator("#chart-system").inner_text()
        for chart in ("gpu-util", "gpu-mem", "gpu-power"):
            assert int(page.locator(f"#chart-{chart}").get_attribute("data-npoints")) >= 40, chart
        assert "system/gpu1/util" in page.locator("#chart-gpu-util").inner_text()
    assert not errors, errors
    assert not blocked, blocked


# --- notes, tags, archive, delete: permissions and escaping ----------------------------------------

def patch(client, url, data):
    return client.patch(url, json.dumps(data), content_type="application/json")


def test_notes_tags_archive_permissions(alice, bob, user, staff_user, make_run):
    from django.test import Client

    run = make_run(user, "finished")
    assert patch(bob, f"/api/runs/{run.pk}", {"note": "mine now"}).status_code == 403
    assert bob.post(f"/runs/{run.pk}/annotate", {"note": "x", "tags": "y"}).status_code == 302
    assert bob.post(f"/runs/{run.pk}/annotate", {"archived": "true"}).status_code == 302
    run.refresh_from_db()
    assert run.note == "" and run.tags == [] and not run.archived

    r = patch(alice, f"/api/runs/{run.pk}", {"note": EVIL, "tags": [EVIL, "april", "april"]})
    assert r.status_code == 200 and r.json()["tags"] == [EVIL, "april"]
    assert patch(alice, f"/api/runs/{run.pk}", {"tags": "x" * 41}).status_code == 400
    assert patch(alice, f"/api/runs/{run.pk}", {"colour": "red"}).status_code == 400
    for page in ("/", f"/runs/{run.pk}/report/", f"/runs/{run.pk}/"):
        html = alice.get(page).content.decode()
        assert EVIL not in html, page
    assert ESCAPED in alice.get(f"/runs/{run.pk}/report/").content.decode()
    assert [r["id"] for r in alice.get("/api/runs?tag=april").json()["runs"]] == [run.pk]

    staff = Client()
    staff.force_login(staff_user)
    assert staff.post(f"/runs/{run.pk}/annotate", {"archived": "true"}).status_code == 302
    assert Run.objects.get(pk=run.pk).archived
    assert run.pk not in [r["id"] for r in alice.get("/api/runs").json()["runs"]]
    assert run.pk in [r["id"] for r in alice.get("/api/runs?archived=1").json()["runs"]]
    assert f'data-run="{run.pk}"' not in alice.get("/").content.decode()
    assert f'data-run="{run.pk}"' in alice.get("/?archived=all").content.decode()
    # an active run cannot be archived
    live = make_run(user, "running")
    assert patch(alice, f"/api/runs/{live.pk}", {"archived": True}).status_code == 400


def test_delete_needs_owner_and_confirmation(alice, bob, user, make_run):
    run = fill(make_run(user, "stopped"))
    ck = actions.run_dir(run.pk) / "checkpoints" / "step_000006"
    ck.mkdir(parents=True)
    (ck / "state.json").write_text("{}")
    assert bob.post(f"/runs/{run.pk}/delete", {"confirm": "delete"}).status_code == 302
    assert bob.delete(f"/api/runs/{run.pk}").status_code == 403
    assert alice.post(f"/runs/{run.pk}/delete").status_code == 302          # not confirmed
    assert Run.objects.filter(pk=run.pk).exists()
    live = make_run(user, "running")
    alice.post(f"/runs/{live.pk}/delete", {"confirm": "delete"})
    assert Run.objects.filter(pk=live.pk).exists()                         # active: refused
    r = alice.post(f"/runs/{run.pk}/delete", {"confirm": "delete"})
    assert r.status_code == 302 and r["Location"] == "/"
    assert not Run.objects.filter(pk=run.pk).exists()
    assert not MetricPoint.objects.filter(run_id=run.pk).exists()
    assert not RunEvent.objects.filter(run_id=run.pk).exists()
    assert not actions.run_dir(run.pk).exists()


def test_checkpoint_buttons(alice, bob, user, make_run):
    run = fill(make_run(user, "stopped"))
    for step in (2, 4):
        ck = actions.run_dir(run.pk) / "checkpoints" / f"step_{step:06d}"
        if step == 4:   # a loadable model (a checkpoint's model is the policy at that step)
            shutil.copytree(builtin_dir(), ck / "model")
        else:           # an empty model folder: a new run from it is refused, naming model.path
            (ck / "model").mkdir(parents=True)
        (ck / "state.json").write_text("{}")
    html = alice.get(f"/runs/{run.pk}/report/").content.decode()
    assert 'data-step="2"' in html and 'data-step="4"' in html and "Resume from here" in html
    assert "Resume from here" not in bob.get(f"/runs/{run.pk}/report/").content.decode()
    assert bob.post(f"/runs/{run.pk}/checkpoints/2", {"action": "resume"}).status_code == 302
    assert Run.objects.get(pk=run.pk).status == "stopped"
    assert alice.post(f"/runs/{run.pk}/checkpoints/3", {"action": "resume"}).status_code == 404
    r = alice.post(f"/runs/{run.pk}/checkpoints/2", {"action": "resume"})
    assert r.status_code == 302 and Run.objects.get(pk=run.pk).status == "queued"
    # a new run from a checkpoint: same config, the checkpoint's weights; the owner's (or staff's)
    r = alice.post(f"/runs/{run.pk}/checkpoints/2", {"action": "new"}, follow=True)
    assert "model.path" in r.content.decode() and Run.objects.count() == 1
    r = alice.post(f"/runs/{run.pk}/checkpoints/4", {"action": "new"})
    new = Run.objects.exclude(pk=run.pk).get()
    assert r["Location"] == f"/runs/{new.pk}/" and new.owner.username == "alice"
    assert new.config["model"]["path"].endswith("step_000004/model")
    assert new.config["optim"] == run.config["optim"]


def test_only_the_owner_or_staff_may_start_a_run_from_a_checkpoint(alice, bob, user, staff_user,
                                                                   make_run, tiny):
    run = fill(make_run(user, "stopped"))
    model = actions.run_dir(run.pk) / "checkpoints" / "step_000004" / "model"
    shutil.copytree(builtin_dir(), model, dirs_exist_ok=True)  # (run ids recur across tests)
    (model.parent / "state.json").write_text("{}")
    html = bob.get(f"/runs/{run.pk}/report/").content.decode()
    assert 'data-step="4"' in html and "New run from here" not in html
    assert "Only the run's owner or staff" in html
    # the form, and the API with the checkpoint's folder as model.path, both refuse bob
    r = bob.post(f"/runs/{run.pk}/checkpoints/4", {"action": "new"}, follow=True)
    assert f"the checkpoints of run {run.pk} belong to its owner" in r.content.decode()
    r = bob.post("/api/runs", {"name": "copy", "overrides": {**tiny, "model.path": str(model)}},
                 content_type="application/json")
    assert r.status_code == 400 and "belong to its owner" in r.json()["errors"]["model.path"]
    assert Run.objects.count() == 1
    # a loadable folder of the runs directory that names no run is no way around it
    orphan = model.parents[3] / "run-999999" / "model"
    shutil.copytree(builtin_dir(), orphan, dirs_exist_ok=True)
    r = bob.post("/api/runs", {"name": "copy", "overrides": {**tiny, "model.path": str(orphan)}},
                 content_type="application/json")
    assert r.status_code == 400 and "names no run" in r.json()["errors"]["model.path"]
    # staff may
    from django.test import Client

    carol = Client()
    carol.force_login(staff_user)
    r = carol.post(f"/runs/{run.pk}/checkpoints/4", {"action": "new"})
    new = Run.objects.exclude(pk=run.pk).get()
    assert r["Location"] == f"/runs/{new.pk}/" and new.owner == staff_user


def test_drop_checkpoints_after(tmp_path):
    from webapp.dashboard.worker.tasks import drop_checkpoints_after

    for step in (2, 4, 6):
        ck = tmp_path / "checkpoints" / f"step_{step:06d}"
        ck.mkdir(parents=True)
        (ck / "state.json").write_text("{}")
    assert drop_checkpoints_after(tmp_path, 4) == ["step_000006"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002", "step_000004"]


# --- alerts ----------------------------------------------------------------------------------------


def stream(run, steps):
    """Feed per-step scalars (and events) through the database sink's write path."""
    sink = DbSink(run.pk, doorbell=NoBell())
    for step, values in steps:
        if isinstance(values, tuple):   # an event (what sink.event buffers, without its thread)
            sink.buffer.append(Record("event", step, values[0], dict(values[1])))
        else:
            sink.scalars(step, values)
        with sink.lock:
            records, sink.buffer = sink.buffer, []
        sink._write(records)
    return [(e.step, e.kind, e.data.get("rule")) for e in
            RunEvent.objects.filter(run=run, kind__in=("alert", "alert_cleared")).order_by("seq")]


def healthy(s):
    return {"async/staleness/max": 1, "async/max_staleness": 2, "actor/kl": 0.001 * s,
            "rollout/zero_var_ratio/all_wrong": 0.3, "actor/pg_loss": 0.1, "reward/mean": 0.5}


def test_no_alerts_on_a_healthy_stream(user, make_run):
    run = make_run(user, "running")
    assert stream(run, [(s, healthy(s)) for s in range(1, 40)]) == []
    assert Run.objects.get(pk=run.pk).alerts["active"] == {}


def test_staleness_alert_raises_once_and_again_after_clearing(user, make_run):
    run = make_run(user, "running")
    st = [1, 3, 3, 3, 2, 1, 1, 4, 4]   # cleared after ALERT_CLEAR_STEPS (3) steps below the bound
    got = stream(run, [(i + 1, {**healthy(i + 1), "async/staleness/max": v}) for i, v in enumerate(st)])
    assert got == [(2, "alert", "staleness"), (7, "alert_cleared", "staleness"), (8, "alert", "staleness")]
    run.refresh_from_db()
    assert "staleness" in run.alerts["active"]
    ev = RunEvent.objects.filter(run=run, kind="alert").first()
    assert ev.data["value"] == 3 and ev.data["threshold"] == 2
    # the banner, on the live page and the report page
    from django.test import Client

    c = Client()
    c.force_login(user)
    for url in (f"/runs/{run.pk}/", f"/runs/{run.pk}/report/"):
        html = c.get(url).content.decode()
        assert 'data-rule="staleness"' in html and "above the bound" in html


def test_kl_alerts(user, make_run, settings):
    settings.ALERT_KL_MAX = 0.5
    run = make_run(user, "running")
    got = stream(run, [(s, {**healthy(s), "actor/kl": kl}) for s, kl in
                       enumerate([0.01, 0.02, 0.6, 0.7, 0.1, 0.1, 0.1], start=1)])
    # raised at the second step above the maximum (one noisy step is no alert)
    assert (4, "alert", "kl_high") in got and (7, "alert_cleared", "kl_high") in got
    assert len([g for g in got if g[2] == "kl_high" and g[1] == "alert"]) == 1
    # one step's spike above the maximum, between healthy ones, is no alert
    spike = make_run(user, "running")
    got = stream(spike, [(s, {**healthy(s), "actor/kl": kl}) for s, kl in
                         enumerate([0.2, 0.55, 0.2, 0.6, 0.2], start=1)])
    assert [g for g in got if g[2] == "kl_high"] == []
    # rising: the median of the last 5 steps (0.3) is at least twice that of the 5 before (0.05)
    # and at least ALERT_KL_RISE_MIN (0.25), while still below the maximum
    settings.ALERT_KL_RISE_WINDOW = 5
    run2 = make_run(user, "running")
    kls = [0.05, 0.05, 0.06, 0.05, 0.06, 0.1, 0.2, 0.3, 0.4, 0.45]
    got = stream(run2, [(s, {**healthy(s), "actor/kl": kl}) for s, kl in enumerate(kls, 1)])
    assert got == [(10, "alert", "kl_rising")]
    ev = RunEvent.objects.get(run=run2, kind="alert", data__rule="kl_rising")
    assert ev.data["value"] == 0.3 and ev.data["before"] == 0.05
    assert "median 0.05 over steps 1-5, 0.3 over steps 6-10" in ev.data["message"]
    # the steady rise of a learning policy is no alert: 0.012 per step up to 0.48 (the earlier
    # slope rule raised it: 0.012 > 0.01 per step), the recent median never twice the earlier one
    run3 = make_run(user, "running")
    got = stream(run3, [(s, {**healthy(s), "actor/kl": 0.012 * s}) for s in range(1, 41)])
    assert [g for g in got if g[2] == "kl_rising"] == []


def test_a_value_hovering_at_a_threshold_raises_one_alert_not_one_per_step(user, make_run, settings):
    settings.ALERT_KL_MAX, settings.ALERT_KL_HIGH_STEPS = 0.5, 1
    run = make_run(user, "running")
    kls = [0.6, 0.4, 0.6, 0.45, 0.55, 0.4, 0.6, 0.3, 0.3, 0.3, 0.6]
    got = stream(run, [(s, {**healthy(s), "actor/kl": kl}) for s, kl in enumerate(kls, 1)])
    assert [g for g in got if g[2] == "kl_high"] == [
        (1, "alert", "kl_high"), (10, "alert_cleared", "kl_high"), (11, "alert", "kl_high")]
    # with ALERT_CLEAR_STEPS = 1, every crossing counts (the earlier behaviour)
    settings.ALERT_CLEAR_STEPS = 1
    run2 = make_run(user, "running")
    got = stream(run2, [(s, {**healthy(s), "actor/kl": kl}) for s, kl in enumerate(kls[:4], 1)])
    assert [g[:2] for g in got if g[2] == "kl_high"] == [(1, "alert"), (2, "alert_cleared"),
                                                         (3, "alert"), (4, "alert_cleared")]


def test_mismatch_alert_fires_on_a_real_mismatch_and_clears(user, make_run, settings):
    """mismatch_high: mismatch/kl past RLPILOT_ALERT_MISMATCH_KL_MAX, or the share of tokens outside
    the band past RLPILOT_ALERT_MISMATCH_OUTSIDE_MAX; raised once, cleared after ALERT_CLEAR_STEPS."""
    assert (settings.ALERT_MISMATCH_KL_MAX, settings.ALERT_MISMATCH_OUTSIDE_MAX) == (0.01, 0.05)   # the defaults
    run = make_run(user, "running")
    kls = [5e-5, 4e-5, 0.03, 0.2, 0.05, 5e-5, 5e-5, 5e-5]
    got = stream(run, [(s, {**healthy(s), "mismatch/kl": kl, "mismatch/outside_band_ratio": 0.0})
                       for s, kl in enumerate(kls, 1)])
    assert got == [(3, "alert", "mismatch_high"), (8, "alert_cleared", "mismatch_high")]
    ev = RunEvent.objects.get(run=run, kind="alert")
    assert ev.data["key"] == "mismatch/kl" and ev.data["value"] == 0.03 and ev.data["threshold"] == 0.01
    assert ev.data["message"] == "engine vs trainer KL (mismatch/kl) 0.03 is above 0.01"
    # the share of tokens outside the band alone, with a small KL
    run2 = make_run(user, "running")
    got = stream(run2, [(s, {**healthy(s), "mismatch/kl": 2e-3, "mismatch/outside_band_ratio": r})
                        for s, r in enumerate([0.0, 0.01, 0.12, 0.0], 1)])
    assert got == [(3, "alert", "mismatch_high")]
    ev = RunEvent.objects.get(run=run2, kind="alert")
    assert ev.data["key"] == "mismatch/outside_band_ratio" and ev.data["threshold"] == 0.05
    assert "12.0% of tokens" in ev.data["message"]
    assert "mismatch_high" in Run.objects.get(pk=run2.pk).alerts["active"]
    # the thresholds are settings
    settings.ALERT_MISMATCH_KL_MAX = 1e-5
    run3 = make_run(user, "running")
    assert stream(run3, [(1, {**healthy(1), "mismatch/kl": 5e-5})]) == [(1, "alert", "mismatch_high")]


def test_a_healthy_mismatch_stays_silent(user, make_run):
    """What the trainer measures on healthy runs: an fp32 engine (~1e-9, nothing outside the band)
    and a bf16 engine against the fp32 trainer on the built-in model (`rollout.dtype = bfloat16`:
    kl ~5e-5, largest |Δ log p| ~0.2 < ln 2, nothing outside [0.5, 2]); a step without the
    figures (mismatch.measure off) changes nothing."""
    run = make_run(user, "running")
    fp32 = [(s, {**healthy(s), "mismatch/kl": 1e-9 * (1 + s % 3), "mismatch/outside_band_ratio": 0.0})
            for s in range(1, 21)]
    bf16 = [(s, {**healthy(s), "mismatch/kl": (5.7e-5, 2.8e-5, 4.2e-5, 4.8e-5)[s % 4],
                 "mismatch/abs_logp_diff_max": 0.19, "mismatch/outside_band_ratio": 0.0 if s % 5 else 0.001})
            for s in range(21, 61)]
    off = [(s, healthy(s)) for s in range(61, 66)]
    assert stream(run, fp32 + bf16 + off) == []
    assert Run.objects.get(pk=run.pk).alerts["active"] == {}
    # an asynchronous run (figures by token age, as a healthy tiny `async` run measured them): its
    # mismatch/kl averages in the policy's drift of stale tokens (0.012); the engine's own is age 0's
    run2 = make_run(user, "running")
    rows = [(1, {"mismatch/kl": 0.0, "mismatch/age0/kl": 0.0}),
            (2, {"mismatch/kl": 4.8e-4, "mismatch/age0/kl": 0.0, "mismatch/age1/kl": 6e-4}),
            (3, {"mismatch/kl": 0.0, "mismatch/age1/kl": 0.0}),    # no fresh token: no engine KL
            (4, {"mismatch/kl": 0.0048, "mismatch/age1/kl": 0.0036, "mismatch/age2plus/kl": 0.0059}),
            (5, {"mismatch/kl": 0.0121, "mismatch/age2plus/kl": 0.0121}),
            (6, {"mismatch/kl": 0.0002, "mismatch/age0/kl": 1e-5, "mismatch/age1/kl": 9e-5,
                 "mismatch/age2plus/kl": 0.0004})]
    assert stream(run2, [(s, {**healthy(s), **r, "mismatch/outside_band_ratio": 0.0}) for s, r in rows]) == []
    # ... and the engine's own KL past the maximum raises it there
    got = stream(run2, [(7, {**healthy(7), "mismatch/kl": 0.03, "mismatch/age0/kl": 0.03,
                             "mismatch/outside_band_ratio": 0.0})])
    assert got == [(7, "alert", "mismatch_high")]
    ev = RunEvent.objects.get(run=run2, kind="alert")
    assert ev.data["key"] == "mismatch/age0/kl" and "(mismatch/age0/kl) 0.03" in ev.data["message"]


def test_reward_collapse_alert(user, make_run, settings):
    settings.ALERT_COLLAPSE_STEPS = 4
    run = make_run(user, "running")
    ws = [1.0, 1.0, 1.0, 0.5, 1.0, 0.97, 1.0, 1.0, 1.0, 1.0, 0.2, 0.2, 0.2]
    got = stream(run, [(s, {**healthy(s), "rollout/zero_var_ratio/all_wrong": w}) for s, w in enumerate(ws, 1)])
    assert got == [(8, "alert", "reward_collapse"), (13, "alert_cleared", "reward_collapse")]


@pytest.mark.parametrize("nan", [float("nan"), "nan", float("inf"), "-inf"])
def test_nan_loss_alert(user, make_run, nan):
    run = make_run(user, "running")
    got = stream(run, [(1, healthy(1)), (2, {**healthy(2), "actor/pg_loss": nan}),
                       (3, {**healthy(3), "actor/pg_loss": nan}), (4, healthy(4)), (5, healthy(5)),
                       (6, healthy(6))])
    assert got == [(2, "alert", "nan_loss"), (6, "alert_cleared", "nan_loss")]
    # the database stores the non-finite value as NULL
    assert MetricPoint.objects.get(run=run, step=2, key="actor/pg_loss").value is None


def test_nan_warning_event_alert(user, make_run):
    run = make_run(user, "running")
    got = stream(run, [(1, healthy(1)), (2, ("warning", {"message": "non-finite loss or gradient; "
                                                                     "the update was skipped"})),
                       (2, ("warning", {"message": "non-finite loss or gradient; the update was skipped"}))])
    assert got == [(2, "alert", "nan_loss")]


def test_alert_state_survives_a_new_sink(user, make_run):
    run = make_run(user, "running")
    stream(run, [(1, {**healthy(1), "async/staleness/max": 5})])
    got = stream(run, [(2, {**healthy(2), "async/staleness/max": 5})])   # a resumed worker
    assert got == [(1, "alert", "staleness")]


def test_heartbeat_alert(user, make_run, settings):
    from datetime import timedelta

    from django.utils import timezone

    run = make_run(user, "running", heartbeat_at=timezone.now() - timedelta(seconds=settings.HEARTBEAT_TIMEOUT_S + 5))
    assert sweep.mark_stale_runs(force=True) == 1
    run.refresh_from_db()
    assert run.status == "interrupted" and "heartbeat" in run.alerts["active"]
    assert RunEvent.objects.filter(run=run, kind="alert", data__rule="heartbeat").count() == 1
    assert sweep.mark_stale_runs(force=True) == 0
    # resuming clears it
    actions.control(run, user, "resume")
    run.refresh_from_db()
    assert "heartbeat" not in run.alerts["active"]
    assert RunEvent.objects.filter(run=run, kind="alert_cleared").exists()


def test_monitor_is_pure_logic():
    from webapp.dashboard.worker.alerts import Monitor, non_finite

    assert non_finite("nan") and non_finite(float("inf")) and non_finite(None) and not non_finite(0.3)
    m = Monitor()
    out = m.check([Record("points", 1, "", {"actor/pg_loss": "NaN"})])
    assert [r.values["rule"] for r in out] == ["nan_loss"]
    assert math.isnan(float("nan"))
