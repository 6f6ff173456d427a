"""No input becomes a 500, and no user reaches the worker's files, hosts or another
user's runs. One test (or a few) per item, each sending the input of the report and checking
the documented answer (docs/dashboard.md, "Security")."""
import asyncio
import http.server
import json
import re
import shutil
import threading

import pytest

from trainer import config as config_mod
from trainer.models.loading import builtin_dir
from webapp.dashboard.access import throttle as login_throttle
from webapp.dashboard.access import validation
from webapp.dashboard.models import Run, Status

pytestmark = pytest.mark.django_db

BIG = "x" * 600_000   # a 600 KB value: never echoed back whole


def post(client, url, data=None, raw=None, **extra):
    body = raw if raw is not None else json.dumps(data if data is not None else {})
    return client.post(url, body, content_type="application/json", **extra)


def patch(client, url, data=None, raw=None):
    body = raw if raw is not None else json.dumps(data)
    return client.patch(url, body, content_type="application/json")


def launch(client, tiny, name="r", **overrides):
    return post(client, "/api/runs", {"name": name, "preset": "demo", "overrides": {**tiny, **overrides}})


def assert_error(r, status, field, contains=""):
    assert r.status_code == status, (r.status_code, r.content[:300])
    body = r.json()
    assert set(body) == {"message", "errors"} and field in body["errors"], body
    assert contains in body["errors"][field], body["errors"][field]
    assert len(r.content) < 4000           # shortened, whatever was sent
    return body


# --- 1. text users type: storable, bounded --------------------------------------------------------

def test_a_tag_with_a_lone_surrogate_is_refused_and_pages_still_render(alice, bob, user, make_run):
    run = make_run(user)
    r = patch(alice, f"/api/runs/{run.pk}", {"tags": ["a\ud800b"]})
    assert_error(r, 400, "tags", "lone UTF-16 surrogate (U+D800)")
    run.refresh_from_db()
    assert run.tags == []
    for client in (alice, bob):
        assert client.get("/").status_code == 200
    assert alice.get(f"/runs/{run.pk}/report/").status_code == 200


@pytest.mark.parametrize("bad, why", [("a\ud800", "surrogate"), ("a\x00b", "NUL")])
def test_names_and_notes_with_surrogates_or_nul_are_400s(alice, user, make_run, tiny, bad, why):
    assert_error(launch(alice, tiny, name=bad), 400, "name", why)
    run = make_run(user)
    assert_error(patch(alice, f"/api/runs/{run.pk}", {"note": bad}), 400, "note", why)
    assert_error(patch(alice, f"/api/runs/{run.pk}", {"tags": [bad]}), 400, "tags", why)
    # config strings (overrides, TOML) too
    assert_error(launch(alice, tiny, **{"data.prompt_template": "{prompt}" + bad}), 400,
                 "data.prompt_template", why)
    # rollout.stop's entries once its JSON is decoded ('["\\u0000"]' is plain ASCII text)
    assert_error(launch(alice, tiny, **{"rollout.stop": json.dumps(["</a>", bad])}), 400,
                 "rollout.stop", why)
    toml = config_mod.to_toml(config_mod.load("demo")).replace('path = "builtin"',
                                                              'path = "builtin"\n# ' + bad)
    assert_error(post(alice, "/api/runs", {"name": "t", "toml": toml}), 400, "toml", why)
    assert not Run.objects.exclude(pk=run.pk).exists()
    assert alice.get("/").status_code == 200


def test_lengths_are_bounded_with_clear_messages(alice, user, make_run, tiny):
    assert_error(launch(alice, tiny, name="n" * 201), 400, "name", "at most 200")
    run = make_run(user)
    assert_error(patch(alice, f"/api/runs/{run.pk}", {"note": "n" * 20_001}), 400, "note",
                 "at most 20000")
    assert_error(patch(alice, f"/api/runs/{run.pk}", {"tags": [f"t{i}" for i in range(21)]}), 400,
                 "tags", "at most 20 tags")
    assert_error(patch(alice, f"/api/runs/{run.pk}", {"tags": ["t" * 41]}), 400, "tags",
                 "at most 40")
    assert_error(patch(alice, f"/api/runs/{run.pk}", {"tags": "a, b, " + "c" * 41}), 400, "tags",
                 "tag 3")
    ok = patch(alice, f"/api/runs/{run.pk}", {"note": "n" * 20_000, "tags": ["t" * 40, "b", "b"]})
    assert ok.status_code == 200 and ok.json()["tags"] == ["t" * 40, "b"]
    assert_error(post(alice, "/api/runs", {"name": "t", "toml": "#" * 200_001}), 400, "toml",
                 "too long")


def test_the_launch_form_refuses_nul_per_field(alice):
    r = alice.post("/", {"name": "a\x00b", "preset": "demo", "cfg:data.prompt_template": "{prompt}\x00"})
    html = r.content.decode()
    assert r.status_code == 400
    assert 'data-error-for="name"' in html and 'data-error-for="data.prompt_template"' in html
    assert not Run.objects.exists()


# --- 2. JSON 400s, not 500s --------------------------------------------------------------------------

@pytest.mark.parametrize("raw", ["[" * 100_000 + "]" * 100_000,            # RecursionError
                                 '{"a": ' * 50_000 + "1" + "}" * 50_000,
                                 '{"overrides": ' + '{"a": ' * 40 + "1" + "}" * 41])  # > 32 levels
def test_deeply_nested_json_is_a_400(alice, user, make_run, raw):
    run = make_run(user)
    for r in (post(alice, "/api/runs", raw=raw), post(alice, f"/api/runs/{run.pk}/knobs", raw=raw),
              patch(alice, f"/api/runs/{run.pk}", raw=raw)):
        assert_error(r, 400, "body", "nested too deeply")


def test_a_400_digit_integer_for_a_float_key_is_a_400(alice, user, make_run, tiny):
    huge = 10 ** 400
    body = assert_error(launch(alice, tiny, **{"optim.lr": huge}), 400, "optim.lr", "expected a number")
    assert "(401 chars)" in body["errors"]["optim.lr"]
    run = make_run(user)
    assert_error(post(alice, f"/api/runs/{run.pk}/knobs", {"optim.lr": huge}), 400, "optim.lr",
                 "expected a number")
    assert_error(post(alice, f"/api/runs/{run.pk}/knobs", raw='{"optim.lr": -Infinity}'), 400,
                 "optim.lr", "expected a number")


def test_huge_ids_are_404s(alice, user, make_run):
    run = make_run(user)
    huge = "9" * 30
    r = alice.get(f"/compare/?ids={run.pk},{huge}")
    assert r.status_code == 404
    assert alice.get(f"/compare/?ids={run.pk},-{huge}").status_code == 404
    r = alice.get(f"/api/runs/{huge}")
    assert r.status_code == 404 and r.json()["errors"] == {"path": "not found"}
    assert alice.get(f"/api/runs/{huge}/metrics").status_code == 404
    assert alice.get(f"/runs/{huge}/").status_code == 404
    assert alice.get(f"/runs/{run.pk}/report/").status_code == 200
    assert alice.get("/api/nothing-here").json()["message"].startswith("no such API endpoint")


def asgi_get(path: str):
    from asgiref.testing import ApplicationCommunicator

    from webapp.asgi import application

    async def go():
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
                 "scheme": "http", "path": path, "raw_path": path.encode("utf-8", "surrogateescape"),
                 "query_string": b"", "root_path": "", "headers": [(b"host", b"127.0.0.1")],
                 "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
        comm = ApplicationCommunicator(application, scope)
        await comm.send_input({"type": "http.request", "body": b"", "more_body": False})
        start = await comm.receive_output(20)
        body = b""
        while True:
            msg = await comm.receive_output(20)
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        await comm.wait(5)
        return start["status"], body
    return asyncio.run(go())


def test_static_paths_that_leave_the_static_folder_are_404s():
    # daphne decodes /static/%2e%2e/... into the scope's path
    for path in ("/static/../webapp/settings.py", "/static/dashboard/../../../webapp/settings.py",
                 "/static/../../../../etc/passwd", "/static/a\x00b"):
        status, body = asgi_get(path)
        assert status == 404, (path, status)
        assert b"SECRET_KEY" not in body
    status, body = asgi_get("/static/dashboard/style.css")
    assert status == 200 and body


# --- 3. SGLang servers only from RLPILOT_SGLANG_URLS --------------------------------------------------

def test_sglang_is_refused_without_an_allow_list(alice, tiny, settings):
    settings.RLPILOT_SGLANG_URLS = []
    r = launch(alice, tiny, **{"rollout.engine": "sglang", "rollout.sglang_urls": "http://10.0.0.1:22"})
    assert_error(r, 400, "rollout.engine", "RLPILOT_SGLANG_URLS")
    r = launch(alice, tiny, **{"rollout.sglang_urls": "http://169.254.169.254:80"})
    assert_error(r, 400, "rollout.sglang_urls", "RLPILOT_SGLANG_URLS")
    r = alice.post("/", {"name": "s", "preset": "demo", "cfg:rollout.engine": "sglang",
                         "cfg:rollout.sglang_urls": "http://10.0.0.1:22"})
    assert r.status_code == 400 and 'data-error-for="rollout.engine"' in r.content.decode()
    assert not Run.objects.exists()


def test_the_launch_form_shows_sglang_disabled_without_an_allow_list(alice, settings):
    settings.RLPILOT_SGLANG_URLS = []
    page = alice.get("/").content.decode()
    (option,) = re.findall(r'<option value="sglang"[^>]*>[^<]*</option>', page)
    assert " disabled" in option and "(not enabled here)" in option and "RLPILOT_SGLANG_URLS" in option
    assert 'data-refused="sglang"' in page
    embedded = re.search(r'<option value="embedded"[^>]*>', page).group(0)
    assert "disabled" not in embedded
    settings.RLPILOT_SGLANG_URLS = ["http://127.0.0.1:30000"]
    page = alice.get("/").content.decode()
    (option,) = re.findall(r'<option value="sglang"[^>]*>[^<]*</option>', page)
    assert "disabled" not in option and 'data-refused="sglang"' not in page


def test_sglang_urls_must_be_on_the_allow_list(alice, tiny, settings):
    settings.RLPILOT_SGLANG_URLS = ["http://127.0.0.1:30000", "http://gpu-a:30000/"]
    sg = {"rollout.engine": "sglang"}
    r = launch(alice, tiny, **sg, **{"rollout.sglang_urls": "http://127.0.0.1:30000,http://evil:1"})
    assert_error(r, 400, "rollout.sglang_urls", "1 server(s) not allowed")
    r = launch(alice, tiny, **sg, **{"rollout.sglang_urls": "http://127.0.0.1:6379"})
    assert_error(r, 400, "rollout.sglang_urls", "http://127.0.0.1:30000")
    r = launch(alice, tiny, **sg, **{"rollout.sglang_urls": "http://127.0.0.1:30000/, HTTP://GPU-A:30000"})
    assert r.status_code == 201, r.content


class _Leaky(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"internal-secret: hunter2 " * 40
        self.send_response(500)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_remote_error_bodies_never_reach_the_run_error():
    from trainer.engine.base import EngineError
    from trainer.engine.sglang import SGLangEngine

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Leaky)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        with pytest.raises(EngineError) as e:
            SGLangEngine(url, retries=0)
    finally:
        srv.shutdown()
        srv.server_close()
    assert "hunter2" not in str(e.value)
    assert url in str(e.value) and "HTTP 500" in str(e.value)


def test_the_worker_checks_the_allow_list_again(user, settings, tiny):
    """A run queued while a URL was allowed (or written by hand) is refused by the worker."""
    from webapp.dashboard.worker.tasks import execute

    cfg = config_mod.load("demo", {**tiny, "rollout.engine": "sglang",
                                   "rollout.sglang_urls": "http://127.0.0.1:30000"})
    run = Run.objects.create(owner=user, name="s", config=cfg.to_dict(), knobs=cfg.knob_values(),
                             max_steps=cfg.run.max_steps, status=Status.QUEUED)
    settings.RLPILOT_SGLANG_URLS = []
    assert execute(Run.objects.get(pk=run.pk)) == Status.FAILED
    run.refresh_from_db()
    assert run.status == Status.FAILED and "refused by this worker's settings" in run.error
    assert "RLPILOT_SGLANG_URLS" in run.error and not run.started_at


# --- 4. engine weights only in the run's own folder -------------------------------------------------------

def test_sglang_weights_dir_is_refused_from_the_web(alice, tiny, tmp_path, settings):
    settings.RLPILOT_SGLANG_URLS = ["http://127.0.0.1:30000"]
    r = launch(alice, tiny, **{"rollout.engine": "sglang", "rollout.sglang_urls": "http://127.0.0.1:30000",
                               "rollout.sglang_weights_dir": str(tmp_path)})
    assert_error(r, 400, "rollout.sglang_weights_dir", "engine_weights")
    r = launch(alice, tiny, **{"rollout.sglang_weights_dir": "/etc"})
    assert_error(r, 400, "rollout.sglang_weights_dir", "must be empty")


def test_the_engine_replaces_and_prunes_only_its_own_weight_folders(tmp_path):
    import torch

    from trainer.engine.base import EngineError
    from trainer.engine.sglang import WEIGHTS_MARKER, SGLangEngine

    foreign = tmp_path / "v000001"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    eng = SGLangEngine("http://127.0.0.1:9", weights_dir=tmp_path, check_health=False)
    try:
        for v in (2, 3, 4):
            eng._save_weights({"w": torch.zeros(2)}, v)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["v000001", "v000003", "v000004"]
        assert (foreign / "precious.txt").read_text() == "keep me"
        assert (tmp_path / "v000004" / WEIGHTS_MARKER).is_file()
        (tmp_path / "v000009").mkdir()
        with pytest.raises(EngineError, match="not written by rlpilot"):
            eng._save_weights({"w": torch.zeros(2)}, 9)
        assert (tmp_path / "v000009").is_dir()
    finally:
        eng.close()


# --- 5. model and data paths under the allowed roots ------------------------------------------------------

@pytest.fixture
def roots(tmp_path, settings):
    models, data, outside = tmp_path / "models", tmp_path / "data", tmp_path / "outside"
    for d in (models, data, outside):
        d.mkdir()
    (outside / "secret.jsonl").write_text('{"prompt": "p", "answer": "1"}\n')
    (data / "ok.jsonl").write_text('{"prompt": "p", "answer": "1"}\n')
    (data / "escape").symlink_to(outside)
    settings.RLPILOT_MODEL_ROOTS = [models]
    settings.RLPILOT_DATA_ROOTS = [data]
    return models, data, outside


def test_model_and_data_paths_must_lie_under_the_roots(alice, tiny, roots):
    models, data, outside = roots
    math = {"data.task": "math"}
    for bad in (str(outside / "secret.jsonl"), f"{data}/../outside/secret.jsonl",
                str(data / "escape" / "secret.jsonl"), "ok.jsonl", "/etc/passwd"):
        assert_error(launch(alice, tiny, **math, **{"data.path": bad}), 400, "data.path",
                     "RLPILOT_DATA_ROOTS")
        assert_error(launch(alice, tiny, **math, **{"data.path": str(data / "ok.jsonl"),
                                                    "data.eval_path": bad}), 400, "data.eval_path")
    for bad in ("/", str(outside), f"{models}/../outside", "relative/model"):
        assert_error(launch(alice, tiny, **{"model.path": bad}), 400, "model.path", "RLPILOT_MODEL_ROOTS")
    assert launch(alice, tiny, **math, **{"data.path": str(data / "ok.jsonl")}).status_code == 201
    assert launch(alice, tiny, **math, **{"data.path": str(data / "not-yet.jsonl")}).status_code == 201
    shutil.copytree(builtin_dir(), models / "my-model")  # inside the roots, and a loadable model
    assert launch(alice, tiny, **{"model.path": str(models / "my-model")}).status_code == 201
    assert launch(alice, tiny, **{"model.path": "builtin"}).status_code == 201


def test_a_data_file_over_the_size_limit_is_refused_at_launch(alice, tiny, roots, monkeypatch):
    _, data, _ = roots
    big = data / "big.jsonl"
    big.write_text('{"prompt": "p", "answer": "1"}\n' * 100)
    monkeypatch.setenv("RLPILOT_MAX_DATA_BYTES", "1000")
    for key in ("data.path", "data.eval_path"):
        paths = {"data.path": str(data / "ok.jsonl"), key: str(big)}
        body = assert_error(launch(alice, tiny, **{"data.task": "math"}, **paths), 400, key,
                            f"{big.stat().st_size} bytes is larger than the 1000 bytes")
        assert "RLPILOT_MAX_DATA_BYTES" in body["errors"][key]
    assert launch(alice, tiny, **{"data.task": "math", "data.path": str(data / "ok.jsonl")}).status_code == 201


def test_path_errors_do_not_reveal_whether_a_file_exists(alice, tiny, roots):
    _, _, outside = roots

    def answer(path):
        return launch(alice, tiny, **{"data.task": "math", "data.path": path}).json()

    assert answer(str(outside / "secret.jsonl")) == answer(str(outside / "no-such.jsonl"))
    assert answer("/etc/passwd") == answer("/etc/no-such-file")
    assert "secret" not in json.dumps(answer(str(outside / "secret.jsonl")))


def test_the_default_roots_allow_checkpoints_of_runs(settings):
    assert settings.RUNS_DIR in settings.RLPILOT_MODEL_ROOTS
    cfg = config_mod.load("demo", {"model.path": str(settings.RUNS_DIR / "run-000001" / "checkpoints"
                                                      / "step_000002" / "model")})
    # allowed by the roots (that it is not there yet is check_model_dir's message, not theirs)
    assert "RLPILOT_MODEL_ROOTS" not in validation.config_problems(cfg).get("model.path", "")


# --- 6. metrics cursors ---------------------------------------------------------------------------------

def test_a_cursor_past_the_runs_last_one_is_a_400(alice, user, make_run):
    run = make_run(user)
    last = Run.objects.get(pk=run.pk).last_seq
    r = alice.get(f"/api/runs/{run.pk}/metrics?after={'9' * 30}")
    assert_error(r, 400, "after", f"past the run's last cursor ({last})")
    assert_error(alice.get(f"/api/runs/{run.pk}/metrics?after={last + 1}"), 400, "after")
    r = alice.get(f"/api/runs/{run.pk}/metrics?after={last}")
    assert r.status_code == 200 and r.json()["cursor"] == last
    assert alice.get(f"/api/runs/{run.pk}/metrics?after=0").status_code == 200
    keys = ",".join(f"k{i}" for i in range(201))
    assert_error(alice.get(f"/api/runs/{run.pk}/metrics?keys={keys}"), 400, "keys")
    assert alice.get(f"/api/runs/{run.pk}/metrics?keys=a%00b").status_code == 200


# --- 7. login throttling and active runs per user ------------------------------------------------------------

@pytest.fixture
def throttle(settings):
    """Three failures per window; the counters of the test's usernames are removed after (never
    cache.clear(): with Redis that would flush a shared database)."""
    settings.RLPILOT_LOGIN_MAX_FAILURES = 3
    settings.RLPILOT_LOGIN_WINDOW_S = 300
    used = []

    def forget(username, ip="127.0.0.1"):
        used.append((username, ip))
    yield forget
    from django.test import RequestFactory

    for username, ip in used:
        login_throttle.login_succeeded(RequestFactory().get("/", REMOTE_ADDR=ip), username)


def test_failed_logins_are_throttled_per_username_and_address(client, user, throttle, monkeypatch):
    throttle("alice")
    throttle("alice", "10.0.0.2")
    bad = {"username": "alice", "password": "wrong"}
    for _ in range(2):
        r = client.post("/accounts/login/", bad)
        assert r.status_code == 200 and "didn't match" in r.content.decode()
    r = client.post("/accounts/login/", bad)            # the third failure
    assert r.status_code == 429 and "Too many failed logins" in r.content.decode()
    wait = re.search(r"wait (\d+) s", r.content.decode())   # 300 s from the first failure, less
    assert wait and 240 <= int(wait.group(1)) <= 300           # the time a loaded machine took since
    r = client.post("/accounts/login/", {"username": "alice", "password": "alice-pw-123"})
    assert r.status_code == 429 and "_auth_user_id" not in client.session   # not even checked
    r = client.post("/accounts/login/", {"username": "Alice ", "password": "alice-pw-123"})
    assert r.status_code == 429
    # another address is not locked out
    r = client.post("/accounts/login/", {"username": "alice", "password": "alice-pw-123"},
                    REMOTE_ADDR="10.0.0.2")
    assert r.status_code == 302
    # the window ends
    now = login_throttle._now()
    monkeypatch.setattr(login_throttle, "_now", lambda: now + 301)
    client.logout()
    r = client.post("/accounts/login/", {"username": "alice", "password": "alice-pw-123"})
    assert r.status_code == 302


def test_behind_trusted_proxies_the_throttle_keys_on_the_forwarded_client(client, user, throttle,
                                                                        settings):
    """Every request comes from the proxy's address; with RLPILOT_TRUSTED_PROXIES = 1 the client is
    X-Forwarded-For's last entry (what the proxy appended), not anything the client wrote."""
    from django.test import RequestFactory

    settings.RLPILOT_TRUSTED_PROXIES = 1
    proxy = {"REMOTE_ADDR": "10.9.9.9"}
    throttle("alice", "10.9.9.9")
    for who in ("198.51.100.7", "203.0.113.5"):
        throttle("alice", who)
    bad = {"username": "alice", "password": "wrong"}
    for spoof in ("1.1.1.1", "2.2.2.2", "3.3.3.3"):   # the client changes what it sends: same key
        r = client.post("/accounts/login/", bad, HTTP_X_FORWARDED_FOR=f"{spoof}, 198.51.100.7", **proxy)
    assert r.status_code == 429
    # another user behind the same proxy is not locked out
    r = client.post("/accounts/login/", {"username": "alice", "password": "alice-pw-123"},
                    HTTP_X_FORWARDED_FOR="203.0.113.5", **proxy)
    assert r.status_code == 302
    addr = login_throttle.client_address
    assert addr(RequestFactory().get("/", HTTP_X_FORWARDED_FOR="a, b, c", REMOTE_ADDR="p")) == "c"
    assert addr(RequestFactory().get("/", REMOTE_ADDR="p")) == "p"   # no header: the peer
    settings.RLPILOT_TRUSTED_PROXIES = 2
    assert addr(RequestFactory().get("/", HTTP_X_FORWARDED_FOR="a, b, c", REMOTE_ADDR="p")) == "b"
    assert addr(RequestFactory().get("/", HTTP_X_FORWARDED_FOR="c", REMOTE_ADDR="p")) == "p"   # too short
    settings.RLPILOT_TRUSTED_PROXIES = 0
    assert addr(RequestFactory().get("/", HTTP_X_FORWARDED_FOR="a", REMOTE_ADDR="p")) == "p"   # not trusted


def test_a_success_resets_the_count_and_the_admin_login_is_throttled_too(client, staff_user,
                                                                         throttle):
    from django.contrib.auth import authenticate
    from django.test import RequestFactory

    throttle("carol")
    req = RequestFactory().post("/accounts/login/", REMOTE_ADDR="127.0.0.1")
    for _ in range(2):
        assert authenticate(req, username="carol", password="wrong") is None
    assert authenticate(req, username="carol", password="carol-pw-123") == staff_user   # resets
    for _ in range(2):
        assert authenticate(req, username="carol", password="wrong") is None
    assert authenticate(req, username="carol", password="carol-pw-123") == staff_user
    for _ in range(3):
        assert authenticate(req, username="carol", password="wrong") is None
    assert authenticate(req, username="carol", password="carol-pw-123") is None
    # /admin/ logs in through the same backend
    client.post("/admin/login/", {"username": "carol", "password": "carol-pw-123"})
    assert "_auth_user_id" not in client.session
    login_throttle.login_succeeded(req, "carol")
    r = client.post("/admin/login/?next=/admin/", {"username": "carol", "password": "carol-pw-123",
                                                   "next": "/admin/"})
    assert r.status_code == 302 and client.session["_auth_user_id"] == str(staff_user.pk)


def test_active_runs_per_user_are_limited(alice, bob, user, other_user, staff_user, tiny, settings):
    from django.test import Client

    settings.RLPILOT_MAX_ACTIVE_RUNS_PER_USER = 2
    assert launch(alice, tiny, name="a").status_code == 201
    assert launch(alice, tiny, name="b").status_code == 201
    r = launch(alice, tiny, name="c")
    body = assert_error(r, 429, "runs", "at most 2 per user")
    assert "RLPILOT_MAX_ACTIVE_RUNS_PER_USER" in body["errors"]["runs"]
    r = alice.post("/", {"name": "form", "preset": "demo"})
    assert r.status_code == 400 and "at most 2 per user" in r.content.decode()
    assert launch(bob, tiny, name="bob's").status_code == 201        # per user
    staff = Client()
    staff.force_login(staff_user)
    for i in range(3):
        assert launch(staff, tiny, name=f"s{i}").status_code == 201   # staff are exempt
    # an ended run frees a place; resuming one takes it again
    first = Run.objects.filter(owner=user).order_by("pk").first()
    assert post(alice, f"/api/runs/{first.pk}/stop").status_code == 202
    assert Run.objects.get(pk=first.pk).status == Status.STOPPED
    assert launch(alice, tiny, name="c").status_code == 201
    assert_error(post(alice, f"/api/runs/{first.pk}/resume"), 429, "runs")
    settings.RLPILOT_MAX_ACTIVE_RUNS_PER_USER = 0                     # no limit
    assert launch(alice, tiny, name="d").status_code == 201


# --- 8. error replies are short --------------------------------------------------------------------------

def test_error_replies_never_echo_a_long_value(alice, user, make_run, tiny):
    run = make_run(user)
    replies = [
        launch(alice, tiny, name=BIG),
        post(alice, "/api/runs", {"name": "x", "preset": BIG}),
        post(alice, "/api/runs", {BIG: 1}),
        launch(alice, tiny, **{BIG: 1}),
        launch(alice, tiny, **{"optim.lr": BIG}),
        launch(alice, tiny, **{"data.prompt_template": BIG}),
        post(alice, "/api/runs", {"name": "x", "toml": "[model]\npath = " + BIG}),
        post(alice, "/api/runs", {"name": "x", "preset": "demo", "queue": BIG}),
        post(alice, f"/api/runs/{run.pk}/knobs", {BIG: 1}),
        post(alice, f"/api/runs/{run.pk}/knobs", {"optim.lr": BIG}),
        post(alice, f"/api/runs/{run.pk}/knobs", {f"k{i}.x": 1 for i in range(5000)}),
        patch(alice, f"/api/runs/{run.pk}", {"note": BIG * 2}),
        patch(alice, f"/api/runs/{run.pk}", {BIG: 1}),
        alice.get(f"/api/runs/{run.pk}/metrics?after={BIG}"),
        alice.get(f"/api/runs?limit={BIG}"),
    ]
    for r in replies:
        assert r.status_code == 400, r.content[:200]
        assert len(r.content) < 10_000, (len(r.content), r.content[:200])
        assert set(r.json()) == {"message", "errors"}
    assert len(replies[10].json()["errors"]) == validation.MAX_ERRORS + 1   # "...": "and N more"
    r = post(alice, "/api/runs", raw='{"name": "' + "x" * 3_000_000 + '"}')
    assert r.status_code == 413 and r.json()["errors"]["body"].startswith("at most")


# --- 9. only the Token scheme is ours ----------------------------------------------------------------------

def test_other_authorization_schemes_fall_through_to_the_session(alice, client, user):
    basic = "Basic YWxpY2U6cHJveHktc2VjcmV0"   # alice:proxy-secret, from an auth proxy
    assert alice.get("/api/runs", HTTP_AUTHORIZATION=basic).status_code == 200
    assert alice.get("/api/runs", HTTP_AUTHORIZATION="Bearer abc").status_code == 200
    r = post(alice, "/api/runs", {"name": "x", "preset": "demo"}, HTTP_AUTHORIZATION=basic)
    assert r.status_code == 201 and Run.objects.get().owner == user
    # a Token header is ours: a bad key is a 401 even with a session
    assert alice.get("/api/runs", HTTP_AUTHORIZATION="Token nope").status_code == 401
    assert alice.get("/api/runs", HTTP_AUTHORIZATION="Token " + "a\x00b").status_code == 401
    from django.test import Client

    anon = Client()
    assert anon.get("/api/runs", HTTP_AUTHORIZATION=basic).status_code == 401
