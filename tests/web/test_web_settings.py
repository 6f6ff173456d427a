"""Importing the settings has no side effect: no folder, no file. What the embedded
setup keeps under RLPILOT_VAR_DIR is created where it is needed (webapp/vardir.py): the SQLite
folder when the database first opens, the broker's folders when a task is sent or a worker starts,
the local secret key when `manage.py serve` or the web server starts. Each check runs in a fresh
interpreter."""
import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT

CLEAN = ("SECRET_KEY", "DATABASE_URL", "REDIS_URL", "RLPILOT_TEST_DB_NAME", "RLPILOT_RUNS_DIR",
         "STATIC_ROOT", "RLPILOT_MODEL_ROOTS", "RLPILOT_DATA_ROOTS")


def fresh_python(code: str, var_dir, **env_extra) -> dict:
    """Run `code` in a new interpreter with RLPILOT_VAR_DIR=var_dir; it prints one JSON line."""
    env = {k: v for k, v in os.environ.items() if k not in CLEAN}
    env.update({"RLPILOT_VAR_DIR": str(var_dir), "DJANGO_SETTINGS_MODULE": "webapp.settings",
                "PYTHONPATH": str(ROOT)}, **env_extra)
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("setup", ["embedded", "redis"])
def test_importing_the_settings_creates_nothing(tmp_path, setup):
    var = tmp_path / "not" / "there"
    extra = {} if setup == "embedded" else {
        "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/rlpilot", "REDIS_URL": "redis://127.0.0.1:6379/0"}
    out = fresh_python("""
        import json, os, pathlib
        var = pathlib.Path(os.environ["RLPILOT_VAR_DIR"])
        import webapp.settings as s
        after_import = var.exists()
        import django
        django.setup()
        from django.core.management import call_command
        call_command("check", verbosity=0)
        import importlib, pkgutil, webapp
        # every module but the server entry points (starting a server keeps the secret key)
        names = [m.name for m in pkgutil.walk_packages(webapp.__path__, "webapp.")
                 if m.name not in ("webapp.asgi", "webapp.wsgi")]
        for name in names:
            importlib.import_module(name)
        print(json.dumps({"after_import": after_import, "after_setup": var.exists(),
                          "generated": s.SECRET_KEY_GENERATED, "key_len": len(s.SECRET_KEY),
                          "var": str(s.VAR_DIR), "modules": len(names)}))
    """, var, **extra)
    assert out == {**out, "after_import": False, "after_setup": False, "generated": True, "var": str(var)}
    assert out["key_len"] >= 50 and out["modules"] > 20
    assert not (tmp_path / "not").exists()


def test_var_is_created_where_it_is_needed(tmp_path):
    var = tmp_path / "var"
    out = fresh_python("""
        import json, os, pathlib
        var = pathlib.Path(os.environ["RLPILOT_VAR_DIR"])
        import django
        django.setup()
        from django.conf import settings
        from django.db import connection
        connection.ensure_connection()              # the database opens: its folder is made
        db = pathlib.Path(connection.settings_dict["NAME"]).exists()
        celery = (var / "celery").exists()
        from webapp.celery import app
        app.send_task("nothing.here", queue="nobody")   # a task is sent: the broker's folders
        queued = [p.name for p in (var / "celery" / "queue").iterdir()]
        from webapp import vardir
        generated = settings.SECRET_KEY
        kept = vardir.ensure_secret_key()               # what serve and the web server's start do
        print(json.dumps({"db": db, "celery_before_send": celery, "queued": queued,
                          "same": kept == generated == settings.SECRET_KEY,
                          "dirs": sorted(p.name for p in (var / "celery").iterdir())}))
    """, var)
    assert out["db"] and not out["celery_before_send"] and out["same"]
    assert len(out["queued"]) == 1 and out["queued"][0].endswith(".nobody.msg")
    assert out["dirs"] == ["control", "processed", "queue"]
    key_file = var / "secret_key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key = key_file.read_text()
    assert len(key) >= 50 and not list(var.glob(".secret_key.*"))
    # the next process reads that key; one that generated its own before the file existed adopts
    # the kept one when it starts serving
    out = fresh_python("""
        import json, os, pathlib
        import webapp.settings as s
        generated_first, read = s.SECRET_KEY_GENERATED, s.SECRET_KEY
        import django
        django.setup()
        from django.conf import settings
        from webapp import vardir
        settings.SECRET_KEY, settings.SECRET_KEY_GENERATED = "another-key", True
        print(json.dumps({"generated": generated_first, "read": read,
                          "adopted": vardir.ensure_secret_key(), "now": settings.SECRET_KEY}))
    """, var)
    assert out == {"generated": False, "read": key, "adopted": key, "now": key}
    assert key_file.read_text() == key


def test_a_worker_start_makes_the_broker_folders(tmp_path):
    var = tmp_path / "var"
    out = fresh_python("""
        import json, os, pathlib
        import django
        django.setup()
        from celery import signals
        var = pathlib.Path(os.environ["RLPILOT_VAR_DIR"])
        before = var.exists()
        signals.celeryd_init.send(sender="w@host", instance=None, conf=None, options={})
        print(json.dumps({"before": before, "dirs": sorted(p.name for p in (var / "celery").iterdir())}))
    """, var)
    assert out == {"before": False, "dirs": ["control", "processed", "queue"]}
