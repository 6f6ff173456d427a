"""Which pages may open a run's WebSocket: the site's own origin (scheme, host and port, as
Django's CSRF check compares them) or CSRF_TRUSTED_ORIGINS; nothing else, not even another port
of the same host, whose pages get the user's cookies too."""
import pytest
from channels.testing import WebsocketCommunicator
from django.test import override_settings

from tests.web.test_web_ws import run_async, session_cookie
from webapp.dashboard.live.origins import origin_allowed

pytestmark = pytest.mark.django_db(transaction=True)


def scope(host, origin, scheme="ws", extra=()):
    headers = [(b"host", host.encode())] if host else []
    if origin:
        headers.append((b"origin", origin.encode()))
    return {"type": "websocket", "scheme": scheme, "headers": headers + list(extra)}


@pytest.mark.parametrize("host, origin, scheme, allowed", [
    ("127.0.0.1:8000", "http://127.0.0.1:8000", "ws", True),
    ("localhost:8000", "http://LOCALHOST:8000", "ws", True),
    ("127.0.0.1:8000", "http://127.0.0.1:8888", "ws", False),   # another port of the same host
    ("127.0.0.1:8000", "http://127.0.0.1", "ws", False),
    ("127.0.0.1:8000", "https://127.0.0.1:8000", "ws", False),  # scheme differs
    ("127.0.0.1:8000", "https://127.0.0.1:8000", "wss", True),
    ("evil.example.com", "http://evil.example.com", "ws", False),  # not in ALLOWED_HOSTS
    ("127.0.0.1:8000", "", "ws", False),
    ("", "http://127.0.0.1:8000", "ws", False),
    ("127.0.0.1:8000", "null", "ws", False),
])
def test_origin_rule(host, origin, scheme, allowed):
    assert origin_allowed(scope(host, origin, scheme)) is allowed


def test_trusted_origins_and_tls_proxy():
    with override_settings(CSRF_TRUSTED_ORIGINS=["https://dash.example.org"]):
        assert origin_allowed(scope("127.0.0.1:8000", "https://dash.example.org"))
    proxied = [(b"x-forwarded-proto", b"https")]
    with override_settings(SECURE_PROXY_SSL_HEADER=("HTTP_X_FORWARDED_PROTO", "https"),
                           ALLOWED_HOSTS=["dash.example.org"]):
        assert origin_allowed(scope("dash.example.org", "https://dash.example.org", extra=proxied))
        assert not origin_allowed(scope("dash.example.org", "http://dash.example.org",
                                        extra=proxied))


def test_a_page_on_another_port_cannot_steer_a_run_with_the_users_cookies(alice, user,
                                                                          make_run):
    from webapp.asgi import application

    run = make_run(user, "running")

    async def go():
        for origin, ok_expected in ((b"http://localhost:8888", False),
                                    (b"http://localhost:8000", True)):
            comm = WebsocketCommunicator(application, f"/ws/runs/{run.pk}/", headers=[
                (b"host", b"localhost:8000"), (b"origin", origin), session_cookie(alice)])
            ok, _ = await comm.connect()
            assert ok is ok_expected, origin
            if ok:
                await comm.disconnect()
    run_async(go())
