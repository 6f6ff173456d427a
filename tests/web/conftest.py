"""Web tests run against one of two setups, chosen before Django starts:

  RLPILOT_TEST_SETUP=embedded (default): SQLite (WAL, a file so other processes share it),
      the filesystem Celery broker, the in-memory channel layer (consumers poll).
  RLPILOT_TEST_SETUP=redis: PostgreSQL (DATABASE_URL, default postgres://postgres@127.0.0.1:5432/
      rlpilot) with Redis (REDIS_URL, default redis://127.0.0.1:6379/0) as Celery broker and
      channel layer. `make test` runs tests/web a second time this way. Missing servers fail
      the tests loudly.

Every session gets its own var/ folder, test database, Celery queue and channel prefix, so
concurrent test sessions (and a running `make run`) do not see each other's tasks.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = os.environ.get("RLPILOT_TEST_SETUP", "embedded")
if SETUP not in ("embedded", "redis"):
    raise RuntimeError(f"RLPILOT_TEST_SETUP={SETUP!r}: expected embedded or redis")
_TMP = Path(tempfile.mkdtemp(prefix=f"rlpilot-web-{SETUP}-"))
_TAG = f"{os.getpid()}"
os.environ["RLPILOT_VAR_DIR"] = str(_TMP)
os.environ["RLPILOT_TRAINING_QUEUE"] = f"training-test-{_TAG}"
os.environ["RLPILOT_CHANNEL_PREFIX"] = f"rlpilot-test-{_TAG}"
os.environ["RLPILOT_HEARTBEAT_S"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
for var in ("DEBUG", "SECRET_KEY", "ALLOWED_HOSTS", "SECURE_SSL_REDIRECT"):
    os.environ.pop(var, None)
if SETUP == "redis":
    os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/rlpilot")
    os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/0")
    os.environ["RLPILOT_TEST_DB_NAME"] = f"test_rlpilot_{_TAG}"
else:
    os.environ.pop("DATABASE_URL", None)
    os.environ.pop("REDIS_URL", None)
    os.environ["RLPILOT_TEST_DB_NAME"] = str(_TMP / "test.sqlite3")
os.environ["DJANGO_SETTINGS_MODULE"] = "webapp.settings"

import django  # noqa: E402

django.setup()

from webapp import vardir  # noqa: E402

# what a server start does (the settings write nothing at import): keep this process's local
# SECRET_KEY in the session's var/ first, so the servers and workers the tests start read the
# same key and accept the sessions the tests log in with
vardir.ensure_secret_key()

TINY = {"rollout.rollout_batch_size": 4, "rollout.n_samples_per_prompt": 4,
        "rollout.max_response_len": 64, "rollout.max_slots": 16, "run.eval_every": 0,
        "run.checkpoint_every": 0, "run.reward_workers": 0, "model.threads": 1}


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.embedded_only`: what the test proves does not depend on the setup (a page
    drawn in the browser, a trainer-side file), so the redis pass (`make test` runs tests/web
    twice) leaves it out; CI time goes to what PostgreSQL, Redis and their broker change."""
    if SETUP != "redis":
        return
    skip = pytest.mark.skip(reason="setup-independent: proved by the embedded pass")
    for item in items:
        if item.get_closest_marker("embedded_only"):
            item.add_marker(skip)


def pytest_report_header(config):
    return f"rlpilot web setup: {SETUP} (var dir {_TMP})"


def pytest_sessionfinish(session, exitstatus):
    if not os.environ.get("RLPILOT_KEEP_TEST_DIR"):
        shutil.rmtree(_TMP, ignore_errors=True)


@pytest.fixture(scope="session")
def setup_name():
    return SETUP


@pytest.fixture(scope="session", autouse=True)
def _servers_reachable():
    """The redis setup needs PostgreSQL and Redis: fail loudly (never skip) when they are down."""
    if SETUP != "redis":
        return
    from urllib.parse import urlparse

    for name in ("DATABASE_URL", "REDIS_URL"):
        u = urlparse(os.environ[name])
        try:
            socket.create_connection((u.hostname, u.port or (5432 if name == "DATABASE_URL" else 6379)),
                                     timeout=3).close()
        except OSError as e:
            pytest.fail(f"{name}={os.environ[name]} is not reachable ({e}); the redis setup of the "
                        "web tests needs PostgreSQL and Redis running", pytrace=False)


@pytest.fixture
def tiny():
    return dict(TINY)


# --- users and clients -----------------------------------------------------------------------

@pytest.fixture
def user(django_user_model):
    return django_user_model.objects.create_user("alice", password="alice-pw-123")


@pytest.fixture
def other_user(django_user_model):
    return django_user_model.objects.create_user("bob", password="bob-pw-123")


@pytest.fixture
def staff_user(django_user_model):
    return django_user_model.objects.create_user("carol", password="carol-pw-123", is_staff=True)


@pytest.fixture
def alice(client, user):
    client.force_login(user)
    return client


@pytest.fixture
def bob(user, other_user):
    from django.test import Client

    c = Client()
    c.force_login(other_user)
    return c


# --- processes: a Celery worker and an ASGI server on the test database ---------------------------

def _test_db_env() -> dict:
    from django.db import connection

    s = connection.settings_dict
    env = dict(os.environ)
    if s["ENGINE"].endswith("sqlite3"):
        env["DATABASE_URL"] = "sqlite:///" + str(s["NAME"])
    else:
        auth = s["USER"] + (":" + s["PASSWORD"] if s["PASSWORD"] else "")
        env["DATABASE_URL"] = f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Proc:
    def __init__(self, name, cmd, env, log: Path):
        self.name, self.log = name, log
        self.fh = open(log, "wb")
        self.p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.fh, stderr=subprocess.STDOUT,
                                  start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.p.returncode}) before {what}:\n{self.text()[-4000:]}")
            if predicate():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name}: no {what} after {timeout} s:\n{self.text()[-4000:]}")

    def stop(self):
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(5)
            except ProcessLookupError:
                pass
        # children that outlived their parent (e.g. a prefork child)
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.fh.close()


@pytest.fixture(scope="session")
def celery_worker(django_db_setup, django_db_blocker):
    from webapp.dashboard.management.commands.serve import worker_command

    env = _test_db_env()
    env["RLPILOT_ESTIMATE_SECONDS"] = "8"   # the launch form's calibrations, short
    proc = Proc("celery worker", worker_command(concurrency=1), env, _TMP / "worker.log")
    try:
        proc.wait_for(lambda: " ready." in proc.text(), 90, "'ready' line")
        yield proc
    finally:
        proc.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def live_asgi(django_db_setup, celery_worker):
    """daphne serving webapp.asgi on the test database; yields its base URL."""
    from webapp.dashboard.management.commands.serve import server_command

    port = _free_port()
    proc = Proc("daphne", server_command("127.0.0.1", port), _test_db_env(), _TMP / "daphne.log")

    def up():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return True
        except OSError:
            return False
    try:
        proc.wait_for(up, 60, "listening port")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(name="wait_until")
def wait_until_fixture():
    return wait_until


# --- headless Chromium ------------------------------------------------------------------------------

CHROMIUM = "/usr/bin/chromium"   # `make test` installs it (apt-get install -y chromium) when run as root
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def prepare_page(page, errors: list, *, timeout_ms: int | None = None, echo_errors: bool = False,
                 dialogs: str | None = None, init_script: str | None = None, on: dict | None = None):
    """Set a page up before its first navigation: its uncaught errors appended to `errors` (printed
    too with echo_errors); `dialogs`: "accept" every dialog (a confirmation), or "fail": count it as
    an error and dismiss it (by default Playwright dismisses them); `init_script` runs in every
    document; `on` maps more page events to their listeners. Returns the page."""
    def page_error(e):
        errors.append(str(e))
        if echo_errors:
            print("page error:", e)

    def dialog(d):
        if dialogs == "accept":
            d.accept()
        else:
            errors.append("dialog: " + d.message)
            d.dismiss()

    if init_script:
        page.add_init_script(init_script)
    page.on("pageerror", page_error)
    if dialogs:
        assert dialogs in ("accept", "fail"), dialogs
        page.on("dialog", dialog)
    for event, listener in (on or {}).items():
        page.on(event, listener)
    if timeout_ms is not None:
        page.set_default_timeout(timeout_ms)
    return page


@contextmanager
def browser_page(*, viewport: dict | None = None, **setup):
    """A page of a headless Chromium (the project's CHROMIUM and ARGS), set up by prepare_page
    (`setup`: its keywords), closed with its browser at the end; yields (page, errors), `errors`
    for the test to assert empty once the block is over. The page has a context of its own (a
    second tab: page.context.new_page(); another session: page.context.browser.new_page()).
    Playwright's sync API runs an event loop in this thread: a test that uses the ORM inside the
    block sets DJANGO_ALLOW_ASYNC_UNSAFE."""
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            context = browser.new_context(**({"viewport": viewport} if viewport else {}))
            yield prepare_page(context.new_page(), errors, **setup), errors
        finally:
            browser.close()


@contextmanager
def logged_in_page(base_url: str, username: str, password: str, *, timeout_ms: int = 30_000, **kwargs):
    """browser_page (the same keywords), logged in through the login form (browser_login)."""
    with browser_page(timeout_ms=timeout_ms, **kwargs) as (page, errors):
        browser_login(page, base_url, username, password)
        yield page, errors


def browser_login(page, base_url: str, username: str, password: str) -> None:
    """Log in through the real login form of a headless-browser page and wait for the runs page."""
    page.goto(base_url + "/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("#login-submit")
    page.wait_for_selector("#launch-form")


def fill_launch_fields(page, fields: dict[str, str]) -> None:
    """Type the launch form's config fields (dotted keys)."""
    for key, value in fields.items():
        page.fill("#f-" + key.replace(".", "\\."), value)


def submit_launch_form(page, fields: dict[str, str]) -> int:
    """Fill the launch form's config fields (dotted keys), submit it and wait for the new run's
    page; returns the run's id (a refused form fails with the form's own field errors)."""
    import re

    fill_launch_fields(page, fields)
    page.click("#launch-submit")
    try:
        page.wait_for_url(re.compile(r"/runs/\d+/$"), timeout=60_000)
    except Exception:
        raise AssertionError("the launch form refused the run: "
                             f"{page.locator('.field-error').all_inner_texts()}") from None
    return int(re.search(r"/runs/(\d+)/", page.url).group(1))


def make_run(owner, status="running", max_steps=100, **fields):
    """A run row without a task (for tests that drive rows directly)."""
    from trainer import config as config_mod
    from webapp.dashboard import actions
    from webapp.dashboard.models import Run

    cfg = config_mod.apply_overrides(config_mod.from_dict(config_mod.preset_dict("demo")),
                                     {**TINY, "run.max_steps": max_steps})
    run = Run.objects.create(owner=owner, name=fields.pop("name", "r"), preset="demo",
                             config=cfg.to_dict(), knobs=cfg.knob_values(), max_steps=max_steps,
                             status=status, **fields)
    actions.event(run.pk, 0, "status", {"status": status, "previous": None})
    run.refresh_from_db()
    return run


@pytest.fixture(name="make_run")
def make_run_fixture():
    return make_run


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup, django_db_blocker):
    """pytest-django's, plus: before the PostgreSQL test database is dropped, end the sessions
    that threads of this process (async consumers' executor) still hold on it."""
    yield
    with django_db_blocker.unblock():
        from django.db import connection

        if connection.vendor == "postgresql":
            with connection.cursor() as cur:
                cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                            "WHERE datname = current_database() AND pid <> pg_backend_pid()")


@pytest.fixture
def test_db_env():
    """Environment for a subprocess that must use this session's test database."""
    return _test_db_env()


@pytest.fixture
def free_port():
    return _free_port()


def kill_active_runs(username: str) -> None:
    """Kill the runs of `username` still active (a browser test that failed may leave its run
    running on the session's worker)."""
    from webapp.dashboard import actions
    from webapp.dashboard.models import ACTIVE, Run

    for run in Run.objects.filter(status__in=ACTIVE, owner__username=username):
        try:
            actions.control(run, run.owner, "kill")
        except Exception as e:   # the test's own failure is what matters
            print(f"run {run.pk} not killed: {e}")
