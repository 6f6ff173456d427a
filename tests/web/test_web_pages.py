"""HTML pages: login, the runs list and launch form, the run page, escaping, CSRF, settings."""
import os
import subprocess
import sys

import pytest

from trainer import config as config_mod
from webapp.dashboard.models import Run

pytestmark = pytest.mark.django_db

EVIL = '<script>alert("x")</script>'


def test_login_flow(client, user):
    r = client.get("/runs/1/")
    assert r.status_code == 302 and r["Location"].startswith("/accounts/login/")
    r = client.post("/accounts/login/", {"username": "alice", "password": "alice-pw-123"})
    assert r.status_code == 302
    assert client.get("/").status_code == 200


def test_runs_page_lists_and_escapes(alice, user, other_user, make_run):
    make_run(user, "running", name=EVIL)
    make_run(other_user, "finished", name="beta")
    r = alice.get("/")
    html = r.content.decode()
    assert r.status_code == 200
    assert EVIL not in html and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in html
    assert "beta" in html
    html = alice.get("/?status=finished").content.decode()
    assert "beta" in html and "&lt;script&gt;" not in html
    html = alice.get("/?owner=alice").content.decode()
    assert "beta" not in html


def test_launch_form_is_built_from_the_schema(alice):
    html = alice.get("/").content.decode()
    for p in config_mod.schema():
        assert f'name="cfg:{p.name}"' in html
    for name in config_mod.preset_names():
        assert f'<option value="{name}"' in html
    # an opt-in preset says what it needs before a launch is refused for it
    needs = config_mod.preset_requires("smollm2-math")
    assert needs and f'<p class="muted" data-preset-requires="smollm2-math">smollm2-math: {needs}</p>' in html
    assert 'name="toml"' in html and 'name="csrfmiddlewaretoken"' in html


def test_launch_form_errors_per_field(alice):
    r = alice.post("/", {"name": "", "preset": "demo", "cfg:optim.lr": "5", "cfg:run.max_steps": "abc"})
    assert r.status_code == 400
    html = r.content.decode()
    assert 'data-error-for="name"' in html
    assert 'data-error-for="optim.lr"' in html and "expected a number in [0.0, 1.0]" in html
    assert 'data-error-for="run.max_steps"' in html
    assert 'value="abc"' in html      # what the user typed is kept (escaped)
    assert not Run.objects.exists()
    r = alice.post("/", {"name": "t", "preset": "", "toml": "[run]\nmax_steps = 'x'"})
    assert r.status_code == 400 and 'data-error-for="run.max_steps"' in r.content.decode()


def test_launch_form_creates_a_run(alice):
    r = alice.post("/", {"name": EVIL, "preset": "demo", "cfg:run.max_steps": "12",
                         "cfg:rollout.temperature": "", "cfg:algo.overlong_penalty": "false"})
    run = Run.objects.get()
    assert r.status_code == 302 and r["Location"] == f"/runs/{run.pk}/"
    assert run.max_steps == 12 and run.name == EVIL
    html = alice.get(f"/runs/{run.pk}/").content.decode()
    assert EVIL not in html
    # (not a bare "cdn": the random CSRF token in the page may contain those letters)
    assert "vendor/plotly.min.js" in html and "//cdn" not in html.lower() and 'src="http' not in html
    assert 'id="run-page"' in html


def test_forms_need_csrf(user):
    from django.test import Client

    c = Client(enforce_csrf_checks=True)
    c.force_login(user)
    assert c.post("/", {"name": "x", "preset": "demo"}).status_code == 403


def test_run_page_for_watchers(bob, user, make_run):
    run = make_run(user, "running")
    html = bob.get(f"/runs/{run.pk}/").content.decode()
    assert 'id="watch-only"' in html
    assert bob.get("/runs/999/").status_code == 404
    assert bob.post(f"/runs/{run.pk}/delete").status_code == 302
    assert Run.objects.filter(pk=run.pk).exists()


def test_plotly_is_vendored():
    from django.conf import settings

    path = settings.BASE_DIR / "static" / "vendor" / "plotly.min.js"
    assert path.stat().st_size > 1_000_000


def test_check_deploy_is_clean_with_production_settings(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPILOT_TEST")}
    env.update({"DEBUG": "false", "SECRET_KEY": "x" * 20 + "-production-secret-key-0123456789-abcdef",
                "ALLOWED_HOSTS": "rlpilot.example.com", "SECURE_SSL_REDIRECT": "true",
                "SECURE_HSTS_SECONDS": "31536000", "SECURE_HSTS_PRELOAD": "true",
                "RLPILOT_VAR_DIR": str(tmp_path)})
    out = subprocess.run([sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
                         cwd=settings_root(), env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no issues" in out.stdout


def settings_root():
    from django.conf import settings

    return settings.BASE_DIR
