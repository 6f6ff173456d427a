"""GET /metrics (Prometheus text format) and GET /health (JSON; 503 naming what is down), both
behind access.refusal."""
from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_safe

from webapp.dashboard.monitoring import access, collector, health


@require_safe
def metrics(request: HttpRequest) -> HttpResponse:
    refused = access.refusal(request)
    if refused is not None:
        return refused
    body, content_type = collector.render(collector.read_snapshot(), request.headers.get("Accept"))
    return HttpResponse(body, content_type=content_type)


@require_safe
async def health_check(request: HttpRequest) -> HttpResponse:
    refused = access.refusal(request)
    if refused is not None:
        return refused
    checks = await health.run_checks()
    down = [name for name, result in checks.items() if not result["ok"]]
    return JsonResponse({"status": "down" if down else "ok", "down": down, "checks": checks},
                        status=503 if down else 200)
