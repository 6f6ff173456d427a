"""Who may read /metrics and /health: nobody while RLPILOT_METRICS_ENABLED is off (404, as if
they did not exist); with it on, a request bearing `Authorization: Bearer <RLPILOT_METRICS_TOKEN>`
(compared in constant time), or anyone when the settings allow no token (RLPILOT_METRICS_ALLOW_NO_TOKEN
without a token; the settings refuse to enable them without either)."""
from __future__ import annotations

import hmac

from django.conf import settings
from django.http import HttpRequest, HttpResponse

REALM = "rlpilot-metrics"


def refusal(request: HttpRequest) -> HttpResponse | None:
    """The reply that refuses this request, or None when it may read the endpoints."""
    if not settings.RLPILOT_METRICS_ENABLED:
        return HttpResponse("Not Found\n", status=404, content_type="text/plain")
    token = settings.RLPILOT_METRICS_TOKEN
    if not token:   # enabled without a token: the settings allowed it explicitly
        return None
    scheme, _, given = request.headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
        return None
    reply = HttpResponse("Unauthorized: send Authorization: Bearer <RLPILOT_METRICS_TOKEN>\n",
                         status=401, content_type="text/plain")
    reply["WWW-Authenticate"] = f'Bearer realm="{REALM}"'
    return reply
