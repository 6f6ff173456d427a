"""The launch (API and form) checks `model.path` before a run is queued, through
trainer.models.loading.check_model_dir in validation.config_problems: a directory inside RLPILOT_MODEL_ROOTS
must exist, hold a config of an architecture the embedded engine runs, weights, and a tokenizer
that loads. Each failure is a 400 with a field error on model.path, and no run is created."""
from __future__ import annotations

import json
import shutil

import pytest

from trainer import config as config_mod
from trainer.models.loading import builtin_dir
from webapp.dashboard.access import validation
from webapp.dashboard.models import Run

pytestmark = pytest.mark.django_db


@pytest.fixture
def models(tmp_path, settings):
    root = tmp_path / "models"
    root.mkdir()
    settings.RLPILOT_MODEL_ROOTS = [root]
    return root


def launch(client, tiny, **overrides):
    body = {"name": "m", "preset": "demo", "overrides": {**tiny, **overrides}}
    return client.post("/api/runs", json.dumps(body), content_type="application/json")


def model_path_error(r) -> str:
    assert r.status_code == 400, (r.status_code, r.content[:300])
    errors = r.json()["errors"]
    assert "model.path" in errors, errors
    return errors["model.path"]


def copy_builtin(dest):
    shutil.copytree(builtin_dir(), dest)
    return dest


def test_a_missing_model_directory_is_a_field_error(alice, tiny, models):
    msg = model_path_error(launch(alice, tiny, **{"model.path": str(models / "nope")}))
    assert "no model directory at" in msg
    msg = model_path_error(launch(alice, tiny, **{"model.path": str(models / "smollm2-135m-instruct")}))
    assert f"python -m trainer import-gguf smollm2 {models / 'smollm2-135m-instruct'}" in msg
    assert not Run.objects.exists()


def test_an_unsupported_architecture_names_it_and_the_supported_ones(alice, tiny, models):
    d = copy_builtin(models / "gpt2")
    conf = json.loads((d / "config.json").read_text())
    conf.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (d / "config.json").write_text(json.dumps(conf))
    msg = model_path_error(launch(alice, tiny, **{"model.path": str(d)}))
    assert "GPT2LMHeadModel (model_type 'gpt2') is not supported by the embedded engine" in msg
    assert "Qwen2ForCausalLM (qwen2)" in msg and "LlamaForCausalLM (llama)" in msg
    assert not Run.objects.exists()


def test_a_tokenizer_that_does_not_load_and_missing_weights(alice, tiny, models):
    d = copy_builtin(models / "broken")
    (d / "tokenizer.json").write_text("{not json")
    msg = model_path_error(launch(alice, tiny, **{"model.path": str(d)}))
    assert "its tokenizer does not load" in msg
    d2 = copy_builtin(models / "noweights")
    for f in d2.glob("*.safetensors"):
        f.unlink()
    assert "has no weights" in model_path_error(launch(alice, tiny, **{"model.path": str(d2)}))
    (models / "empty").mkdir()
    assert "has no config.json" in model_path_error(launch(alice, tiny, **{"model.path": str(models / "empty")}))


def test_a_loadable_model_inside_the_roots_is_queued(alice, tiny, models):
    d = copy_builtin(models / "mine")
    r = launch(alice, tiny, **{"model.path": str(d)})
    assert r.status_code == 201, r.content[:300]
    assert Run.objects.get().config["model"]["path"] == str(d)


def test_the_launch_form_shows_the_model_path_error_on_its_field(alice, models):
    r = alice.post("/", {"name": "form", "preset": "demo", "cfg:model.path": str(models / "nope")})
    assert r.status_code == 400
    html = r.content.decode()
    assert 'data-error-for="model.path"' in html and "no model directory at" in html
    assert not Run.objects.exists()


def test_a_path_outside_the_roots_is_refused_before_it_is_looked_at(alice, tiny, models, tmp_path):
    outside = copy_builtin(tmp_path / "outside-model")
    here = model_path_error(launch(alice, tiny, **{"model.path": str(outside)}))
    gone = model_path_error(launch(alice, tiny, **{"model.path": str(tmp_path / "no-such-model")}))
    assert here == gone and "RLPILOT_MODEL_ROOTS" in here   # reveals nothing outside the roots


def test_the_worker_check_sees_a_model_removed_after_the_launch(models):
    d = copy_builtin(models / "soon-gone")
    cfg = config_mod.load("demo", {"model.path": str(d)})
    assert validation.config_problems(cfg) == {}
    shutil.rmtree(d)
    assert "no model directory at" in validation.config_problems(cfg)["model.path"]


def test_the_opt_in_preset_names_its_model_under_the_project_and_says_how_to_make_it(alice, settings):
    """smollm2-math's model.path is relative (var/models/...): the web reads it inside this server's
    RLPILOT_VAR_DIR, so the user meets the missing model and its import command, not a path rule."""
    want = settings.VAR_DIR / "models" / "smollm2-135m-instruct"
    settings.RLPILOT_MODEL_ROOTS = [settings.VAR_DIR / "models"]
    body = {"name": "s", "preset": "smollm2-math", "overrides": {"run.max_steps": 2}}
    r = alice.post("/api/runs", json.dumps(body), content_type="application/json")
    if want.exists():   # imported on this machine: the launch goes through
        assert r.status_code == 201, r.content[:300]
        assert Run.objects.get().config["model"]["path"] == str(want)
        return
    msg = model_path_error(r)
    assert "absolute" not in msg and "not allowed" not in msg
    assert f"import-gguf smollm2 {want}" in msg
