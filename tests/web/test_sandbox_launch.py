"""A run that executes model-written code needs its isolation boundary: where it cannot be set up,
the launch (API and form, and the CLI) is refused with one message on `sandbox.isolation` that
names what is missing and how to install it or opt out; a run that executes no model code is not
refused; the opt-out (`sandbox.isolation = "process"`) launches, and its live page, report and
HTML export say in red that its code is not isolated."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer import config as config_mod
from trainer.sandbox import WEAK_WARNING
from webapp.dashboard.models import Run

pytestmark = pytest.mark.django_db
ROOT = Path(__file__).resolve().parents[2]
PYTHON_TOOL = {"episode.tools": "calculator,python"}


@pytest.fixture
def no_bwrap(monkeypatch):
    monkeypatch.setattr("trainer.sandbox.preflight.unavailable",
                        lambda isolation: None if isolation == "process" else
                        "bubblewrap (bwrap) is not installed: install bubblewrap (Debian/Ubuntu: "
                        "apt-get install bubblewrap; `make run` and `make test` do)")


def launch(client, tiny, preset="agent", **overrides):
    body = {"name": "s", "preset": preset, "overrides": {**tiny, **overrides}}
    return client.post("/api/runs", json.dumps(body), content_type="application/json")


def test_the_python_tool_without_the_boundary_is_refused_by_name(alice, tiny, no_bwrap):
    r = launch(alice, tiny, **PYTHON_TOOL)
    assert r.status_code == 400, r.content[:300]
    msg = r.json()["errors"]["sandbox.isolation"]
    assert "the python tool (episode.tools)" in msg and "apt-get install bubblewrap" in msg
    assert "sandbox.isolation = 'process'" in msg
    assert not Run.objects.exists()


def test_a_run_without_model_code_is_not_refused(alice, tiny, no_bwrap):
    assert launch(alice, tiny, preset="demo").status_code in (200, 201)
    assert launch(alice, tiny).status_code in (200, 201)   # the agent preset: calculator only


def test_the_opt_out_launches_and_its_pages_say_it_is_not_isolated(alice, tiny, no_bwrap):
    r = launch(alice, tiny, **PYTHON_TOOL, **{"sandbox.isolation": "process"})
    assert r.status_code in (200, 201), r.content[:300]
    run = Run.objects.get()
    for url in (f"/runs/{run.pk}/", f"/runs/{run.pk}/report/",
                f"/api/runs/{run.pk}/export?format=html"):
        html = alice.get(url).content.decode()
        assert 'id="sandbox-warning"' in html and "Not isolated" in html, url
        assert WEAK_WARNING.split(":")[0] in html.replace("&#x27;", "'"), url


def test_a_run_with_the_boundary_shows_no_warning(alice, tiny):
    r = launch(alice, tiny, preset="demo")
    assert r.status_code in (200, 201), r.content[:300]
    run = Run.objects.get()
    assert 'id="sandbox-warning"' not in alice.get(f"/runs/{run.pk}/").content.decode()
    cfg = config_mod.from_dict(run.config)
    assert cfg.sandbox.isolation == "bwrap"


def test_the_cli_refuses_before_making_a_run_directory(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PATH": str(tmp_path)}   # no bwrap on PATH
    p = subprocess.run([sys.executable, "-m", "trainer", "run", "agent", "--set",
                        "episode.tools=calculator,python", "--out", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "sandbox.isolation" in p.stderr and "bubblewrap" in p.stderr
    assert not out.exists()
