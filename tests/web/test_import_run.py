"""Importing a run directory the CLI wrote (`manage.py import_run`, the runs page's upload): a real
tiny CLI run becomes a dashboard run with the same rows as the same config launched from the
dashboard, its report page draws its charts, bad directories are refused with the file and line,
a killed run's cut-short last line is imported with a warning, a second import is refused, a
hostile archive is refused, and a real Celery worker resumes an imported run from its checkpoint."""
from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT, TINY
from django.core.management import CommandError, call_command

from webapp.dashboard import actions
from webapp.dashboard.models import HistogramSnapshot, MetricPoint, RolloutSample, Run, RunEvent

pytestmark = [pytest.mark.slow]

STEPS = 4
# the tiny run, 4 steps, a checkpoint every 2 (checkpoints/step_000002 and step_000004)
SETTINGS = {**TINY, "run.max_steps": STEPS, "run.checkpoint_every": 2}
# metrics that depend on the machine's speed, not on the training
CLOCK = ("timing/", "perf/", "proc/", "system/", "cost/")   # what the clock decides


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "trainer", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory) -> Path:
    """A real CLI run of the tiny config (python -m trainer run demo --out DIR)."""
    out = tmp_path_factory.mktemp("cli") / "tiny-cli"
    sets = [a for k, v in SETTINGS.items() for a in ("--set", f"{k}={v}")]
    cli("run", "demo", *sets, "--out", str(out))
    return out


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def killed_after(src: Path, dst: Path, step: int) -> Path:
    """What a CLI run killed right after `step` leaves behind: its files up to that step and the
    checkpoints saved by then (no end event)."""
    copy_run(src, dst)
    for kind in ("metrics", "histograms", "samples", "timeline", "events"):
        path = dst / f"{kind}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        keep = [r for r in rows if r["step"] <= step and r.get("kind") not in ("run_finished", "run_stopped")]
        path.write_text("".join(json.dumps(r) + "\n" for r in keep))
    for ck in (dst / "checkpoints").iterdir():
        if int(ck.name.rsplit("_", 1)[1]) > step:
            shutil.rmtree(ck)
    return dst


def file_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def import_cmd(directory, owner="alice", **opts) -> tuple[Run, str, str]:
    out, err = io.StringIO(), io.StringIO()
    extra = [a for k, v in opts.items() for a in (f"--{k}", v)]
    call_command("import_run", str(directory), "--owner", owner, *extra, stdout=out, stderr=err)
    run = Run.objects.order_by("-pk").first()
    return run, out.getvalue(), err.getvalue()


def series(run_id: int) -> dict[int, dict[str, float | None]]:
    """{step: {metric key: value}}: what the charts read."""
    out: dict[int, dict] = {}
    for step, key, value in MetricPoint.objects.filter(run_id=run_id).values_list("step", "key", "value"):
        assert key not in out.setdefault(step, {}), f"step {step} has {key} twice"
        out[step][key] = value
    return out


def training_values(points: dict[int, dict]) -> dict[int, dict]:
    return {s: {k: v for k, v in row.items() if not k.startswith(CLOCK)} for s, row in points.items()}


# --- the same run, imported and launched --------------------------------------------------------------

@pytest.mark.embedded_only
@pytest.mark.django_db(transaction=True)
def test_an_imported_run_has_the_rows_of_the_same_run_launched_from_the_dashboard(
        cli_run, celery_worker, alice, user, wait_until):
    run, out, err = import_cmd(cli_run)
    assert out.strip() == f"imported as run #{run.pk} 'tiny-cli': finished, step {STEPS}/{STEPS}, owner alice"
    assert err == ""
    r = alice.post("/api/runs", json.dumps({"name": "launched", "preset": "demo", "overrides": SETTINGS}),
                   content_type="application/json")
    assert r.status_code == 201, r.content
    launched = r.json()["id"]
    wait_until(lambda: Run.objects.filter(pk=launched, status__in=("finished", "failed")).exists(), 180,
               "the launched run to end")
    live = Run.objects.get(pk=launched)
    assert live.status == "finished", live.error + celery_worker.text()[-3000:]
    run.refresh_from_db()
    assert (run.owner, run.status, run.step, run.max_steps) == (user, "finished", STEPS, STEPS)
    assert run.config == live.config and run.knobs == live.knobs

    imported, launched_points = series(run.pk), series(live.pk)
    assert sorted(imported) == list(range(1, STEPS + 1))
    # a process's CPU share needs a window of more than 50 ms since its last reading
    # (trainer/observe/system.py): on a fast step it may be missing from one run and not the other
    def keys(points):
        return {s: sorted(k for k in v if not k.endswith("/cpu_pct")) for s, v in points.items()}
    assert keys(imported) == keys(launched_points)
    assert training_values(imported) == training_values(launched_points)   # same seed, same training

    def hists(rid):
        return sorted(HistogramSnapshot.objects.filter(run_id=rid).values_list("step", "name"))
    assert hists(run.pk) == hists(live.pk) and len(hists(run.pk)) >= STEPS

    def samples(rid):
        return sorted(RolloutSample.objects.filter(run_id=rid).values_list("step", "group", "index", "completion",
                                                                            "reward"))
    assert samples(run.pk) == samples(live.pk) and samples(run.pk)
    assert run.timeline.count() == live.timeline.count() >= STEPS
    # the summary: the trainer's final one (what Runner.summary() gave the live run) and the key figures
    assert run.summary["final"] == live.summary["final"] and run.summary["final"]["steps"] == STEPS
    assert set(run.summary["latest"]) == set(live.summary["latest"])
    # the events: the trainer's, with their times in the files; then what the import says
    kinds = list(RunEvent.objects.filter(run=run).order_by("seq").values_list("kind", flat=True))
    assert kinds[:2] == ["status", "run_started"] and kinds[-3:] == ["run_finished", "status", "imported"]
    started = next(r for r in file_rows(cli_run / "events.jsonl") if r["kind"] == "run_started")
    assert run.started_at.timestamp() == pytest.approx(started["time"], abs=1e-3)
    at = RunEvent.objects.get(run=run, kind="run_started").time
    assert at.timestamp() == pytest.approx(started["time"], abs=1e-3)
    # the API's metrics (the charts' source) agree
    for rid in (run.pk, live.pk):
        data = alice.get(f"/api/runs/{rid}/metrics?keys=reward/accuracy").json()
        assert data["points"]["reward/accuracy"]["steps"] == list(range(1, STEPS + 1))
    # its checkpoints are its own (hard links into its folder): the source can go
    folder = actions.run_dir(run.pk) / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step_000002", "step_000004"]


@pytest.mark.embedded_only
@pytest.mark.django_db(transaction=True)
def test_the_report_page_of_an_uploaded_run_draws_its_charts(cli_run, live_asgi, django_user_model,
                                                            tmp_path, monkeypatch):
    """Upload through the runs page's form in headless Chromium, then count what Plotly drew."""
    from conftest import logged_in_page

    django_user_model.objects.create_user("erin", password="erin-pw-123")
    archive = tmp_path / "tiny-cli.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(cli_run, arcname="tiny-cli")
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    drawn = """() => Object.fromEntries([...document.querySelectorAll('#charts .js-plotly-plot')]
      .filter(gd => (gd.data || []).length && gd.data.every(t => t.type === 'scatter'))
      .map(gd => [gd.id, (gd.data || []).map((t, i) => ((gd.calcdata || [])[i] || []).length)]))"""
    with logged_in_page(live_asgi, "erin", "erin-pw-123", timeout_ms=60_000) as (page, errors):
        page.set_input_files("#id_archive", str(archive))
        page.click("#import-submit")
        page.wait_for_url("**/runs/*/")
        assert "Imported as run #" in page.locator(".messages").inner_text()
        rid = int(page.url.rstrip("/").rsplit("/", 1)[1])
        assert page.locator("#run-status").inner_text() == "finished"
        page.goto(f"{live_asgi}/runs/{rid}/report/")
        page.wait_for_function("() => document.querySelectorAll('#charts .js-plotly-plot').length >= 3")
        page.wait_for_function("() => { const gd = document.getElementById('chart-reward');"
                               " return gd && gd.calcdata && gd.calcdata.length; }")
        charts = page.evaluate(drawn)
    assert not errors, errors
    # every line chart drew its traces; the reward chart one point per step and trace
    assert charts["chart-reward"] and all(n == STEPS for n in charts["chart-reward"]), charts
    assert len(charts) >= 3 and all(any(n for n in traces) for traces in charts.values()), charts
    assert Run.objects.get(pk=rid).owner.username == "erin"


# --- a killed run, a resumed CLI run, and resuming from the dashboard ------------------------------------

@pytest.mark.django_db
def test_a_cut_short_last_line_is_imported_up_to_the_line_before_with_a_warning(cli_run, alice, user, tmp_path):
    d = copy_run(cli_run, tmp_path / "killed")
    text = (d / "metrics.jsonl").read_text()
    lines = text.splitlines(keepends=True)
    (d / "metrics.jsonl").write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    run, out, err = import_cmd(d)
    n = len(lines)
    want = (f"metrics.jsonl line {n} was cut short (the run was killed while writing it): "
            f"imported up to line {n - 1}")
    assert err.strip() == f"warning: {want}"
    assert sorted(series(run.pk)) == list(range(1, STEPS))   # the last step's metrics are gone
    assert run.step == STEPS - 1
    assert RunEvent.objects.get(run=run, kind="warning").data == {"message": want}
    report = alice.get(f"/runs/{run.pk}/report/").content.decode()
    assert want in report and f"from {d} (by alice)" in report


@pytest.mark.django_db
def test_a_whole_last_line_without_its_newline_is_imported_without_a_warning(cli_run, user, tmp_path):
    d = copy_run(cli_run, tmp_path / "no-newline")
    (d / "metrics.jsonl").write_text((d / "metrics.jsonl").read_text().rstrip("\n"))
    run, _, err = import_cmd(d)
    assert err == "" and sorted(series(run.pk)) == list(range(1, STEPS + 1))


@pytest.mark.django_db
def test_a_run_that_failed_is_imported_failed_with_its_error(cli_run, user, tmp_path):
    d = killed_after(cli_run, tmp_path / "failed", 3)
    died = file_rows(d / "metrics.jsonl")[-1]["time"] + 0.5
    with open(d / "events.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "time": died, "kind": "error", "message": "RuntimeError: out of memory"}) + "\n")
    run, _, _ = import_cmd(d)
    assert (run.status, run.error, run.step) == ("failed", "RuntimeError: out of memory", 3)
    assert "final" not in run.summary and "resume" in run.allowed_actions
    assert run.finished_at.timestamp() == pytest.approx(died, abs=1e-3)


@pytest.mark.django_db
def test_a_killed_run_is_imported_as_interrupted(cli_run, user, tmp_path):
    run, _, _ = import_cmd(killed_after(cli_run, tmp_path / "killed", 3))
    assert (run.status, run.step) == ("interrupted", 3)
    assert "records no end" in run.error and "resume" in run.allowed_actions
    assert sorted(p.name for p in (actions.run_dir(run.pk) / "checkpoints").iterdir()) == ["step_000002"]


@pytest.mark.django_db
def test_a_run_resumed_on_the_cli_keeps_the_steps_it_trained_again(cli_run, user, tmp_path):
    """`python -m trainer run --resume` appends: the steps after the checkpoint come twice in
    the files; the import keeps the later copy (one row per step)."""
    d = killed_after(cli_run, tmp_path / "resumed", 3)
    first = {r["step"]: r for r in file_rows(d / "metrics.jsonl")}
    cli("run", "--resume", str(d))
    rows = file_rows(d / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 3, 4]   # step 3 trained again after the checkpoint
    run, _, _ = import_cmd(d)
    assert (run.status, run.step) == ("finished", STEPS)
    points = series(run.pk)
    assert sorted(points) == [1, 2, 3, 4]
    again = rows[3]
    assert points[3]["timing/step_s"] == pytest.approx(again["timing/step_s"])
    assert points[3]["timing/step_s"] != pytest.approx(first[3]["timing/step_s"])
    hist_steps = list(HistogramSnapshot.objects.filter(run=run, name="rollout/response_len")
                      .order_by("step").values_list("step", flat=True))
    assert hist_steps == [1, 2, 3, 4]
    assert RolloutSample.objects.filter(run=run).values("step").distinct().count() == STEPS
    assert len(set(RolloutSample.objects.filter(run=run).values_list("step", "group", "index"))) \
        == RolloutSample.objects.filter(run=run).count()
    assert run.summary["final"]["steps"] == STEPS


@pytest.mark.embedded_only
@pytest.mark.django_db(transaction=True)
def test_the_dashboard_resumes_an_imported_run_from_its_last_checkpoint(cli_run, celery_worker, alice,
                                                                        tmp_path, wait_until):
    run, _, _ = import_cmd(killed_after(cli_run, tmp_path / "killed", 3))
    assert run.status == "interrupted"
    r = alice.post(f"/api/runs/{run.pk}/resume", "{}", content_type="application/json")
    assert r.status_code == 202, r.content
    wait_until(lambda: Run.objects.filter(pk=run.pk, status__in=("finished", "failed")).exists(), 180,
               "the resumed run to end")
    run.refresh_from_db()
    assert run.status == "finished", run.error + celery_worker.text()[-3000:]
    assert run.step == STEPS
    rewound = RunEvent.objects.get(run=run, kind="rewound")
    assert rewound.data == {"step": 2, "from_checkpoint": True}
    assert RunEvent.objects.get(run=run, kind="run_resumed").step == 2
    # one row per step: step 3 of the killed run was trained again from the checkpoint at 2
    points = series(run.pk)
    assert sorted(points) == [1, 2, 3, 4]
    full = {r["step"]: r for r in file_rows(cli_run / "metrics.jsonl")}
    assert points[4]["train/policy_version"] == full[4]["train/policy_version"] == STEPS
    assert run.summary["final"]["steps"] == STEPS
    assert (actions.run_dir(run.pk) / "checkpoints" / "step_000004").is_dir()


# --- refused ----------------------------------------------------------------------------------------------

def run_folders() -> list[str]:
    """The runs folder's run folders and import work folders."""
    from django.conf import settings

    return sorted(p.name for p in settings.RUNS_DIR.glob("*"))


def refused(directory, owner="alice") -> str:
    """The command's refusal; nothing was written (no run, no run folder)."""
    before, folders = Run.objects.count(), run_folders()
    with pytest.raises(CommandError) as e:
        import_cmd(directory, owner)
    assert Run.objects.count() == before and run_folders() == folders
    return str(e.value)


@pytest.mark.django_db
def test_garbage_in_the_middle_is_refused_with_the_line(cli_run, user, tmp_path):
    d = copy_run(cli_run, tmp_path / "garbled")
    lines = (d / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[1] = lines[1][:40] + "\n"
    (d / "metrics.jsonl").write_text("".join(lines))
    message = refused(d)
    assert message.startswith("not imported: metrics.jsonl: line 2: invalid JSON ("), message


@pytest.mark.django_db
def test_a_directory_without_config_or_with_a_bad_config_is_refused(cli_run, user, tmp_path):
    d = copy_run(cli_run, tmp_path / "noconfig")
    (d / "config.toml").unlink()
    assert refused(d) == f"not imported: config.toml: missing: {d} is not a run directory the CLI wrote"
    d = copy_run(cli_run, tmp_path / "badconfig")
    (d / "config.toml").write_text((cli_run / "config.toml").read_text().replace(
        "max_response_len = 64", "max_response_len = -3"))
    message = refused(d)
    assert message.startswith("not imported: config.toml: rollout.max_response_len: "), message
    d = copy_run(cli_run, tmp_path / "elsewhere")
    (d / "config.toml").write_text((cli_run / "config.toml").read_text().replace(
        'path = "builtin"', 'path = "/etc"', 1))
    assert "model.path: not allowed" in refused(d)
    d = copy_run(cli_run, tmp_path / "nometrics")
    (d / "metrics.jsonl").unlink()
    assert refused(d) == "not imported: metrics.jsonl: missing: not a run directory the CLI wrote"
    assert "no user 'nobody'" in refused(cli_run, owner="nobody")


@pytest.mark.django_db
def test_importing_twice_is_refused_naming_the_first_import(cli_run, user, tmp_path):
    run, _, _ = import_cmd(cli_run)
    assert refused(cli_run) == f"already imported as run #{run.pk}"
    # the same directory elsewhere (a copy, an upload) is the same run
    assert refused(copy_run(cli_run, tmp_path / "copy")) == f"already imported as run #{run.pk}"


# --- uploads ----------------------------------------------------------------------------------------------

def upload(client, filename: str, data: bytes, **post):
    from django.core.files.uploadedfile import SimpleUploadedFile

    return client.post("/runs/import", {"archive": SimpleUploadedFile(filename, data), **post}, follow=True)


def page_messages(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def tar_bytes(entries) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for info, data in entries:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def file_entry(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


@pytest.mark.django_db
def test_an_uploaded_archive_is_imported(cli_run, alice, user, tmp_path, settings):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for p in sorted(cli_run.rglob("*")):
            if p.is_file():
                zf.write(p, p.relative_to(cli_run))   # the files at the archive's top
    r = upload(alice, "my-run.zip", buf.getvalue(), name="from zip")
    run = Run.objects.get()
    assert r.redirect_chain[-1][0] == f"/runs/{run.pk}/"
    assert page_messages(r) == [f"Imported as run #{run.pk} (finished)."]
    assert (run.name, run.owner, run.status) == ("from zip", user, "finished")
    assert RunEvent.objects.get(run=run, kind="imported").data["source"] == "upload my-run.zip"
    assert sorted(p.name for p in (actions.run_dir(run.pk) / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    assert not list(settings.RUNS_DIR.glob(".import-*"))   # the unpacked upload is gone


@pytest.mark.django_db
@pytest.mark.parametrize("case", ["traversal", "absolute", "symlink", "hardlink", "device", "too-many",
                                  "zip-traversal", "zip-symlink", "not-an-archive", "no-config"])
def test_a_hostile_or_wrong_archive_is_refused(case, alice, user, tmp_path, settings):
    settings.MAX_IMPORT_FILES = 5
    outside = settings.VAR_DIR / "evil.txt"
    if case == "traversal":
        data, why = tar_bytes([file_entry("run/config.toml", b""), file_entry("run/../../evil.txt", b"x")]), \
            "a path leaving the archive's folder is not allowed"
    elif case == "absolute":
        data, why = tar_bytes([file_entry(str(outside), b"x")]), "absolute paths are not allowed"
    elif case in ("symlink", "hardlink"):
        link = tarfile.TarInfo("run/config.toml")
        link.type, link.linkname = (tarfile.SYMTYPE if case == "symlink" else tarfile.LNKTYPE), "/etc/passwd"
        data, why = tar_bytes([(link, None)]), "links are not allowed"
    elif case == "device":
        dev = tarfile.TarInfo("run/null")
        dev.type = tarfile.CHRTYPE
        data, why = tar_bytes([(dev, None)]), "only files and folders are allowed"
    elif case == "too-many":
        data, why = tar_bytes([file_entry(f"run/f{i}", b"x") for i in range(6)]), \
            "more than 5 entries (RLPILOT_MAX_IMPORT_FILES)"
    elif case.startswith("zip"):
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            if case == "zip-traversal":
                zf.writestr("../evil.txt", "x")
                why = "a path leaving the archive's folder is not allowed"
            else:
                info = zipfile.ZipInfo("run/config.toml")
                info.external_attr = 0o120777 << 16   # a symbolic link
                zf.writestr(info, "/etc/passwd")
                why = "links are not allowed"
        data = buf.getvalue()
    elif case == "not-an-archive":
        data, why = b"just text\n" * 10, "not a .zip or .tar.gz archive"
    else:
        data, why = tar_bytes([file_entry("a/metrics.jsonl", b"{}\n"), file_entry("b/x", b"")]), \
            "no config.toml at the archive's top or in its one top-level folder: archive the run directory itself"
    r = upload(alice, "run.tar.gz", data)
    assert r.redirect_chain[-1][0] == "/"
    [message] = page_messages(r)
    assert message.startswith("Not imported: run.tar.gz: ") and message.endswith(why), message
    assert not Run.objects.exists() and not list(settings.VAR_DIR.rglob("evil.txt"))
    assert not list(settings.RUNS_DIR.glob(".import-*"))


@pytest.mark.django_db
def test_an_upload_past_the_limit_is_refused_unread(alice, user, settings):
    settings.MAX_IMPORT_BYTES = 1000
    r = upload(alice, "big.tar.gz", b"x" * 5000)
    assert page_messages(r) == ["Not imported: the upload is larger than the 1000 bytes this server "
                                "accepts (RLPILOT_MAX_IMPORT_BYTES)."]
    assert not Run.objects.exists()
