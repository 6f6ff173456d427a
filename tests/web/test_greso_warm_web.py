"""greso.warm_start from the dashboard: the launch (API and form) takes a run folder of this
server whose statistics the user may read, refuses anything else on the field, and the report
says how many prompts started warm."""
from __future__ import annotations

import json

import pytest

from trainer import config as config_mod
from trainer.rollout.greso import GresoFilter
from trainer.run import checkpoint
from webapp.dashboard import actions
from webapp.dashboard.models import Run

pytestmark = pytest.mark.django_db


def source_run(make_run, owner, **config):
    """A finished run row with a folder holding its config.toml and a checkpoint whose trainer
    state has GRESO statistics for two prompts."""
    run = make_run(owner, "finished")
    folder = actions.run_dir(run.pk)
    cfg = config_mod.apply_overrides(config_mod.from_dict(run.config), config)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text(config_mod.to_toml(cfg))
    ck = checkpoint.checkpoint_root(folder) / "step_000003"
    ck.mkdir(parents=True, exist_ok=True)
    (ck / "state.json").write_text("{}")
    greso = GresoFilter()
    greso.record("sum:0:1", 3, [1.0, 1.0])
    greso.record("sum:0:2", 3, [0.0, 0.0])
    checkpoint.write_trainer_state(ck, {"greso": greso.state_dict()})
    return folder


def launch(client, tiny, **overrides):
    body = {"name": "warm", "preset": "demo", "overrides": {**tiny, **overrides}}
    return client.post("/api/runs", json.dumps(body), content_type="application/json")


def warm_error(r) -> str:
    assert r.status_code == 400, (r.status_code, r.content[:300])
    return r.json()["errors"]["greso.warm_start"]


def test_a_run_of_the_same_task_is_taken(alice, user, tiny, make_run):
    folder = source_run(make_run, user)
    r = launch(alice, tiny, **{"greso.warm_start": str(folder)})
    assert r.status_code == 201, r.content[:300]
    assert Run.objects.get(name="warm").config["greso"]["warm_start"] == str(folder)


def test_what_cannot_be_a_source_is_refused_on_the_field(alice, bob, user, tiny, make_run, tmp_path):
    folder = source_run(make_run, user)
    assert "RLPILOT_RUNS_DIR" in warm_error(launch(alice, tiny, **{"greso.warm_start": str(tmp_path)}))
    assert "belong to its owner" in warm_error(launch(bob, tiny, **{"greso.warm_start": str(folder)}))
    assert "run.seed is 0 there, 7 here" in warm_error(
        launch(alice, tiny, **{"greso.warm_start": str(folder), "run.seed": 7}))
    other = source_run(make_run, user, **{"data.max_operand": 5})
    assert "data.max_operand is 5 there, 9 here" in warm_error(
        launch(alice, tiny, **{"greso.warm_start": str(other)}))
    assert not Run.objects.filter(name="warm").exists()


def test_the_launch_form_has_the_fields_and_shows_the_error_on_its_field(alice, user, make_run, tmp_path):
    html = alice.get("/").content.decode()
    assert 'name="cfg:greso.warm_start"' in html and 'name="cfg:greso.forget_half_life"' in html
    r = alice.post("/", {"name": "form", "preset": "demo", "cfg:greso.warm_start": str(tmp_path)})
    assert r.status_code == 400
    page = r.content.decode()
    assert 'data-error-for="greso.warm_start"' in page and "RLPILOT_RUNS_DIR" in page
    r = alice.post("/", {"name": "form", "preset": "demo", "cfg:greso.forget_half_life": "-2"})
    assert r.status_code == 400 and 'data-error-for="greso.forget_half_life"' in r.content.decode()


def test_the_report_says_how_many_prompts_started_warm(alice, user, make_run):
    cold = make_run(user, "finished")
    actions.event(cold.pk, 0, "run_started", {"max_steps": 3})
    assert 'data-key="greso_warm_prompts"' not in alice.get(f"/runs/{cold.pk}/report/").content.decode()
    run = make_run(user, "finished")
    actions.event(run.pk, 0, "run_started", {"max_steps": 3, "greso_warm_start": {
        "source": "/runs/run-000001", "checkpoint_step": 3, "prompts": 417}})
    html = alice.get(f"/runs/{run.pk}/report/").content.decode()
    assert 'data-key="greso_warm_prompts"' in html
    assert "prompts that started with GRESO history (warm start)" in html and "417" in html
