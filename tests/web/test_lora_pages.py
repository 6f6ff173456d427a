"""LoRA on the dashboard: what a run trains on its run and report pages (LoRA's rank and alpha
from its config, the trainer's figures from its latest run_started / run_resumed), the adapter's
download beside the report's exports (a .zip of the trainer's export of a real tiny LoRA run's
checkpoint; 404 naming why for a full run or a run without a checkpoint; its owner or staff only),
and the launch form's [lora] fields with the config checks' messages by their field."""
from __future__ import annotations

import io
import json
import re
import shutil
import tempfile
import zipfile
from pathlib import Path

import pytest
from helpers import TINY_RUN

from webapp.dashboard import actions, formatting
from webapp.dashboard.actions import Record
from webapp.dashboard.models import Run

pytestmark = pytest.mark.django_db

LORA_SIZES = {"trainable_params": 77824, "total_params": 879232, "adapter_bytes": 311296}
LORA_TEXT = "LoRA r=8, α=16: 77,824 trainable parameters of 879,232 (8.9%), adapter 304 KiB"


def lora_run(make_run, owner, status="finished", rank=8, alpha=16.0, **fields) -> Run:
    run = make_run(owner, status, **fields)
    run.config["lora"].update({"rank": rank, "alpha": alpha})
    run.save(update_fields=["config"])
    return run


def started(run, kind="run_started", step=0, **sizes):
    actions.append(run.pk, [Record("event", step, kind, {"max_steps": run.max_steps, "device": "cpu",
                                                         "model_dtype": "float32", **sizes})])


def head_text(html: str, element_id: str) -> str:
    m = re.search(rf'id="{element_id}">([^<]*)<', html)
    assert m, f"no #{element_id} in the page"
    return m.group(1)


# --- the words -----------------------------------------------------------------------------------

def test_what_trains_in_words():
    assert formatting.trains({"rank": 8, "alpha": 16.0}, LORA_SIZES) == LORA_TEXT
    assert formatting.trains({"rank": 0, "alpha": 16.0}, {"trainable_params": 879232, "total_params": 879232,
                                                         "adapter_bytes": 0}) == "full fine-tuning: 879,232 parameters"
    # before the run started (or a run recorded before the trainer reported its sizes)
    assert formatting.trains({"rank": 4, "alpha": 0.5}, None) == "LoRA r=4, α=0.5"
    assert formatting.trains(None, None) == "full fine-tuning"
    big = {"trainable_params": 4_194_304, "total_params": 7_000_000_000, "adapter_bytes": 16 * 2**20}
    assert formatting.trains({"rank": 8, "alpha": 32}, big) == (
        "LoRA r=8, α=32: 4,194,304 trainable parameters of 7,000,000,000 (0.06%), adapter 16 MiB")
    assert [formatting.byte_size(n) for n in (512, 311296, 1536, 5_452_595, 3 * 2**30)] == [
        "512 bytes", "304 KiB", "1.5 KiB", "5.2 MiB", "3 GiB"]


# --- run page and report -------------------------------------------------------------------------

def test_a_lora_run_s_pages_say_what_trains(alice, user, make_run):
    run = lora_run(make_run, user)
    started(run, **LORA_SIZES)
    live = alice.get(f"/runs/{run.pk}/").content.decode()
    report = alice.get(f"/runs/{run.pk}/report/").content.decode()
    assert head_text(live, "run-trains") == LORA_TEXT
    assert head_text(report, "report-trains") == LORA_TEXT
    # the offline HTML report says it too
    html = alice.get(f"/api/runs/{run.pk}/export?format=html").content.decode()
    assert head_text(html, "report-trains") == LORA_TEXT
    # the live page's event frames carry the line, so a page open before the start shows it
    events = alice.get(f"/api/runs/{run.pk}/metrics").json()["events"]
    assert [e.get("trains") for e in events if e.get("kind") == "run_started"] == [LORA_TEXT]


def test_a_full_run_s_pages_say_full_fine_tuning(alice, user, make_run):
    run = make_run(user, "finished")
    assert run.config["lora"]["rank"] == 0
    started(run, trainable_params=879232, total_params=879232, adapter_bytes=0)
    for url, element in ((f"/runs/{run.pk}/", "run-trains"), (f"/runs/{run.pk}/report/", "report-trains")):
        html = alice.get(url).content.decode()
        assert head_text(html, element) == "full fine-tuning: 879,232 parameters"
        assert "adapter-download" not in html


def test_the_latest_start_or_resume_gives_the_figures(alice, user, make_run):
    run = lora_run(make_run, user, "queued", rank=4, alpha=8.0)
    assert head_text(alice.get(f"/runs/{run.pk}/").content.decode(), "run-trains") == "LoRA r=4, α=8"
    started(run, trainable_params=100, total_params=1000, adapter_bytes=400)
    started(run, "run_resumed", step=5, trainable_params=200, total_params=2000, adapter_bytes=2048)
    started(run, "run_resumed", step=6)   # a resume recorded without figures changes nothing
    assert head_text(alice.get(f"/runs/{run.pk}/report/").content.decode(), "report-trains") == (
        "LoRA r=4, α=8: 200 trainable parameters of 2,000 (10%), adapter 2 KiB")


# --- the adapter's download ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_lora_run_dir(tmp_path_factory):
    """A real tiny LoRA run directory (one step, checkpointed) and its config, trained once."""
    from trainer import config as C
    from trainer.observe.metrics import MemorySink
    from trainer.run.runner import Runner

    folder = tmp_path_factory.mktemp("lora-run") / "run"
    cfg = C.load("demo", TINY_RUN + ["lora.rank=4", "lora.alpha=8", "run.max_steps=1",
                                     "run.checkpoint_every=1"])
    sink = MemorySink()
    with Runner(cfg, folder, sink=sink, system_telemetry=False) as runner:
        runner.run()
    start = next(e for e in sink.events if e["kind"] == "run_started")
    return folder, cfg, start


@pytest.fixture
def lora_row(tiny_lora_run_dir):
    """make(owner): a finished run row whose folder (RLPILOT_RUNS_DIR/run-N) holds the tiny LoRA
    run's files, with its run_started event; the folders go at the end (ids are reused)."""
    folder, cfg, start = tiny_lora_run_dir
    made = []

    def make(owner) -> Run:
        run = Run.objects.create(owner=owner, name="lora", preset="demo", config=cfg.to_dict(),
                                 knobs=cfg.knob_values(), max_steps=1, step=1, status="finished")
        shutil.rmtree(actions.run_dir(run.pk), ignore_errors=True)
        shutil.copytree(folder, actions.run_dir(run.pk))
        made.append(actions.run_dir(run.pk))
        data = {k: v for k, v in start.items() if k not in ("step", "kind")}
        actions.append(run.pk, [Record("event", 0, "run_started", data)])
        return run
    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


def _temporary_folders() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("rlpilot-adapter-*")}


def test_the_adapter_downloads_as_a_zip_of_the_trainer_s_export(alice, user, lora_row):
    from safetensors.torch import load, load_file

    run = lora_row(user)
    folder = actions.run_dir(run.pk)
    before, temporary = _files(folder), _temporary_folders()

    report = alice.get(f"/runs/{run.pk}/report/").content.decode()
    assert head_text(report, "report-trains").startswith("LoRA r=4, α=8: ")
    assert "adapter " in head_text(report, "report-trains")
    link = re.search(r'<a href="([^"]+)" download id="adapter-download"[^>]*>([^<]*)</a>', report)
    assert link and link.group(1) == f"/api/runs/{run.pk}/export?format=adapter"
    assert link.group(2) == "LoRA adapter (.zip, step 1)"

    r = alice.get(link.group(1))
    assert r.status_code == 200 and r["Content-Type"] == "application/zip"
    name = f"rlpilot-run-{run.pk}-adapter-step-1"
    assert f'filename="{name}.zip"' in r["Content-Disposition"]
    z = zipfile.ZipFile(io.BytesIO(b"".join(r.streaming_content)))
    names = set(z.namelist())
    assert {f"{name}/adapter_config.json", f"{name}/adapter_model.safetensors"} <= names
    assert all(n.startswith(name + "/") for n in names)
    config = json.loads(z.read(f"{name}/adapter_config.json"))
    assert config["r"] == 4 and config["lora_alpha"] == 8
    # the tensors are the checkpoint's adapters
    got = load(z.read(f"{name}/adapter_model.safetensors"))
    want = load_file(folder / "checkpoints" / "step_000001" / "model" / "adapter_model.safetensors")
    assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in want)

    # nothing written in the run's folder, and no temporary folder left behind
    assert _files(folder) == before
    assert _temporary_folders() <= temporary

    # a step without a checkpoint names the ones there; a step that is no number is a 400
    r = alice.get(f"/api/runs/{run.pk}/export?format=adapter&step=7")
    assert r.status_code == 404 and "no checkpoint at step 7" in r.json()["message"]
    assert "step 1" in r.json()["message"]
    assert alice.get(f"/api/runs/{run.pk}/export?format=adapter&step=x").status_code == 400
    assert alice.get(f"/api/runs/{run.pk}/export?format=adapter&step=1").status_code == 200


def test_the_adapter_is_its_owner_s(bob, staff_user, client, user, lora_row):
    run = lora_row(user)
    r = bob.get(f"/api/runs/{run.pk}/export?format=adapter")
    assert r.status_code == 403 and "owner or staff" in r.json()["message"]
    report = bob.get(f"/runs/{run.pk}/report/").content.decode()
    assert "adapter-download" not in report and 'id="adapter-owner-only"' in report
    assert bob.get(f"/api/runs/{run.pk}/export?format=csv").status_code == 200   # the rest stays open
    client.force_login(staff_user)
    assert client.get(f"/api/runs/{run.pk}/export?format=adapter").status_code == 200


def test_no_adapter_for_a_full_run_or_a_run_without_checkpoint(alice, user, make_run):
    full = make_run(user, "finished")
    r = alice.get(f"/api/runs/{full.pk}/export?format=adapter")
    assert r.status_code == 404
    assert r.json()["message"] == (f"run {full.pk} trains the whole model (lora.rank = 0): it has no "
                                   "LoRA adapter")
    no_checkpoint = lora_run(make_run, user)
    shutil.rmtree(actions.run_dir(no_checkpoint.pk), ignore_errors=True)   # another test's, same id
    r = alice.get(f"/api/runs/{no_checkpoint.pk}/export?format=adapter")
    assert r.status_code == 404 and "has no checkpoint on disk yet" in r.json()["message"]
    for run in (full, no_checkpoint):
        html = alice.get(f"/runs/{run.pk}/report/").content.decode()
        assert "format=adapter" not in html and "adapter-owner-only" not in html
        assert "format=html" in html   # the other exports are there


# --- the launch form -----------------------------------------------------------------------------

def test_the_launch_form_has_the_lora_fields(alice):
    html = alice.get("/").content.decode()
    assert "<summary>[lora]</summary>" in html
    for key, placeholder in (("lora.rank", "0"), ("lora.alpha", "16.0"), ("lora.dropout", "0.0"),
                             ("lora.target_modules", "all-linear")):
        m = re.search(rf'<input type="text" name="cfg:{re.escape(key)}" id="f-{re.escape(key)}"[^>]*>', html)
        assert m, key
        assert f'placeholder="{placeholder}"' in m.group(0), (key, m.group(0))


@pytest.mark.parametrize("fields, key, words", [
    ({"lora.rank": "4", "lora.target_modules": ","}, "lora.target_modules", "name at least one module"),
    ({"lora.rank": "8", "lora.alpha": "0"}, "lora.alpha", "expected a number in [0.001, 100000.0]"),
    ({"lora.rank": "-1"}, "lora.rank", "expected an integer in [0, 1024]"),
    ({"lora.rank": "4", "lora.dropout": "0.95"}, "lora.dropout", "expected a number in [0.0, 0.9]"),
])
def test_a_bad_lora_value_is_shown_by_its_field(alice, fields, key, words):
    post = {"name": "lora try", "preset": "demo", "toml": "", "queue": ""}
    post.update({"cfg:" + k: v for k, v in fields.items()})
    r = alice.post("/", post)
    assert r.status_code == 400 and not Run.objects.exists()
    html = r.content.decode()
    m = re.search(rf'<span class="field-error" data-error-for="{re.escape(key)}">([^<]*)</span>', html)
    assert m and words in m.group(1), (key, m and m.group(1))
    # the field keeps what was typed, and its section is open
    assert re.search(rf'id="f-{re.escape(key)}" value="{re.escape(fields.get(key, ""))}"', html) or key not in fields
    section = html.split("<summary>[lora]</summary>")[0].rsplit("<details", 1)[1]
    assert " open" in section
