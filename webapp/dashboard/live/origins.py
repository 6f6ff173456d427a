"""Which pages may open the run WebSocket: this site's own origin, compared as Django's CSRF
check compares an HTTP request's Origin (scheme, host and port), or one of
CSRF_TRUSTED_ORIGINS. Channels' AllowedHostsOriginValidator compares host names only, so a
page served from another port of the same host (a notebook, a dev server) could use a
logged-in user's cookies to steer her runs; browsers send cookies to every port of a host."""
from __future__ import annotations

from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.http.request import split_domain_port, validate_host


def _headers(scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def origin_allowed(scope) -> bool:
    headers = _headers(scope)
    origin, host = headers.get("origin", ""), headers.get("host", "")
    if not origin or not host:
        return False  # browsers always send both; a missing one is not a page of ours
    domain, _ = split_domain_port(host)
    if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
        return False
    secure = scope.get("scheme") == "wss"
    proxy = getattr(settings, "SECURE_PROXY_SSL_HEADER", None)
    if proxy:  # behind a TLS proxy the socket itself is plain ws
        name = proxy[0].removeprefix("HTTP_").replace("_", "-").lower()
        secure = headers.get(name, "").split(",")[0].strip() == proxy[1]
    own = f"{'https' if secure else 'http'}://{host}".lower()
    return origin.lower() == own or origin in settings.CSRF_TRUSTED_ORIGINS


class SameOriginValidator:
    """ASGI middleware: a WebSocket handshake from any other origin is refused (403)."""

    def __init__(self, application):
        self.application = application

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket" and not origin_allowed(scope):
            return await WebsocketDenier()(scope, receive, send)
        return await self.application(scope, receive, send)
