"""GET /health: is every part the dashboard needs up? Four checks, run concurrently:

- database: a `SELECT 1` round trip;
- channel_layer: a message sent to a throwaway channel and received back (the doorbell's path);
- broker: the Celery broker answers (the queue lengths of broker.py: Redis pinged and LLEN, or
  the filesystem broker's folder read);
- worker: a Celery worker is alive -- a live run's heartbeat younger than
  RLPILOT_HEARTBEAT_TIMEOUT_S (free: one query), else a worker answering a ping within
  RLPILOT_HEALTH_PING_TIMEOUT_S (any worker, the stale-run sweep's included).

Each check gives {"ok": true, ...} or {"ok": false, "error": "..."}; a check that takes longer
than CHECK_TIMEOUT_S fails."""
from __future__ import annotations

import asyncio
import secrets
import time
from datetime import timedelta

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import connection
from django.utils import timezone

from webapp.dashboard import lifecycle
from webapp.dashboard.models import Run
from webapp.dashboard.monitoring import broker
from webapp.dashboard.monitoring.collector import worker_node

CHECK_TIMEOUT_S = 5.0


async def check_database() -> dict:
    def select_one():
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    await sync_to_async(select_one)()
    return {"vendor": connection.vendor}


async def check_channel_layer() -> dict:
    layer = get_channel_layer()
    if layer is None:
        raise RuntimeError("no channel layer is configured (CHANNEL_LAYERS)")
    channel = await layer.new_channel()
    nonce = secrets.token_hex(8)
    await layer.send(channel, {"type": "health.probe", "nonce": nonce})
    received = await asyncio.wait_for(layer.receive(channel), settings.CHANNEL_LAYER_TIMEOUT_S)
    if received.get("nonce") != nonce:
        raise RuntimeError(f"received {received!r} instead of the probe sent")
    return {"backend": type(layer).__name__}


async def check_broker() -> dict:
    lengths = await sync_to_async(broker.queue_lengths, thread_sensitive=False)(broker.watched_queues())
    return {"broker": settings.CELERY_BROKER_URL.partition(":")[0], "queue_lengths": lengths}


def _beating_workers() -> list[str]:
    since = timezone.now() - timedelta(seconds=settings.HEARTBEAT_TIMEOUT_S)
    hosts = (Run.objects.filter(status__in=lifecycle.LIVE, heartbeat_at__gte=since)
             .values_list("worker_host", flat=True))
    return sorted({worker_node(h) for h in hosts if h})


async def check_worker() -> dict:
    beating = await sync_to_async(_beating_workers)()
    if beating:
        return {"seen_by": "heartbeat", "workers": beating}
    timeout = settings.RLPILOT_HEALTH_PING_TIMEOUT_S
    answered = await sync_to_async(broker.ping_workers, thread_sensitive=False)(timeout)
    if answered:
        return {"seen_by": "ping", "workers": answered}
    raise RuntimeError(f"no live run's worker beat within {settings.HEARTBEAT_TIMEOUT_S:g} s and no "
                       f"Celery worker answered a ping within {timeout:g} s")


CHECKS = {"database": check_database, "channel_layer": check_channel_layer,
          "broker": check_broker, "worker": check_worker}


async def _run(check) -> dict:
    t0 = time.perf_counter()
    try:
        found = await asyncio.wait_for(check(), max(CHECK_TIMEOUT_S, settings.RLPILOT_HEALTH_PING_TIMEOUT_S + 2))
        result = {"ok": True, **found}
    except asyncio.TimeoutError:
        result = {"ok": False, "error": "no answer in time"}
    except Exception as e:
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
    return {**result, "ms": round((time.perf_counter() - t0) * 1000, 1)}


async def run_checks() -> dict[str, dict]:
    results = await asyncio.gather(*(_run(check) for check in CHECKS.values()))
    return dict(zip(CHECKS, results))
