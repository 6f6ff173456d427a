"""`make run` (manage.py serve): migrate, admin user, ASGI server + Celery worker, the URL, the
stale-run sweep on its own timer, the local secret key kept, and a clean stop on Ctrl-C."""
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from datetime import timedelta

import pytest

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_serve_starts_and_stops_cleanly(tmp_path, django_user_model, test_db_env, free_port, user,
                                        make_run, wait_until):
    from django.conf import settings
    from django.utils import timezone

    from webapp.dashboard.models import Run, RunEvent

    port = free_port
    env = dict(test_db_env)
    env.update({"RLPILOT_VAR_DIR": str(tmp_path / "var"), "RLPILOT_PORT": str(port),
                "RLPILOT_HEARTBEAT_TIMEOUT_S": "2", "RLPILOT_SWEEP_S": "0.5"})
    env.pop("RLPILOT_ADMIN_PASSWORD", None)
    p = subprocess.Popen([sys.executable, "manage.py", "serve"], cwd=settings.BASE_DIR, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "rlpilot dashboard: http://" in line:
                break
        out = "".join(lines)
        assert f"http://127.0.0.1:{port}/" in out, out
        m = re.search(r"created user 'admin' with password: (\S+)", out)
        assert m, out                       # generated and printed once
        admin = django_user_model.objects.get(username="admin")
        assert admin.is_staff and admin.check_password(m.group(1))
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/accounts/login/", timeout=5) as r:
                    assert r.status == 200
                break
            except OSError:
                assert time.monotonic() < deadline, "the server never answered"
                time.sleep(0.3)
        # the local secret key, kept before the server started (settings write nothing)
        key_file = tmp_path / "var" / "secret_key"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and len(key_file.read_text()) >= 50
        # serve's own timer sweeps: a run whose worker stops beating now becomes interrupted,
        # with its alert, while nobody opens a page (the login page above does not sweep)
        run = make_run(user, "running", heartbeat_at=timezone.now() - timedelta(seconds=1))
        wait_until(lambda: Run.objects.filter(pk=run.pk, status="interrupted").exists(), 15,
                   "serve's sweeper to mark the run interrupted")
        assert RunEvent.objects.filter(run_id=run.pk, kind="alert", data__rule="heartbeat").count() == 1
        os.killpg(p.pid, signal.SIGINT)     # Ctrl-C reaches the whole foreground group
        rest, _ = p.communicate(timeout=60)
        assert p.returncode == 0, out + rest
        assert "stopped." in rest
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
