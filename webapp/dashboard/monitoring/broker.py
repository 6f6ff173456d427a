"""The Celery broker seen from the web process: how many tasks wait in each queue, and which
workers answer a ping.

Queue lengths come from kombu's own count for the broker in use: for Redis the LLEN of the
queue's list (summed over kombu's priority lists), for the embedded filesystem broker the message
files of that queue in its folder."""
from __future__ import annotations

from amqp.exceptions import ChannelError
from django.conf import settings

from webapp.celery import app

CONNECT_TIMEOUT_S = 2.0


def watched_queues() -> list[str]:
    """The training queues a run may be sent to, then the stale-run sweep's queue."""
    return list(dict.fromkeys([*settings.RLPILOT_QUEUES, settings.SWEEP_QUEUE]))


def queue_lengths(queues: list[str]) -> dict[str, int]:
    """{queue: tasks waiting}; raises (kombu's OperationalError, OSError) when the broker is
    unreachable."""
    # (the socket timeouts bound a connect to an unreachable Redis; the filesystem broker ignores them)
    with app.connection_for_read(transport_options={"socket_connect_timeout": CONNECT_TIMEOUT_S,
                                                    "socket_timeout": CONNECT_TIMEOUT_S}) as conn:
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=CONNECT_TIMEOUT_S)
        channel = conn.default_channel   # Redis: connects and pings
        lengths = {}
        for queue in queues:
            try:
                lengths[queue] = channel.queue_declare(queue=queue, passive=True).message_count
            except ChannelError:   # Redis keeps no list for an empty queue: nothing waits
                lengths[queue] = 0
            except FileNotFoundError:   # the filesystem broker's folder: made by the first task sent
                lengths[queue] = 0
        return lengths


def ping_workers(timeout: float) -> list[str]:
    """The node names of the Celery workers that answer a ping within `timeout` seconds (returns
    at the first answer)."""
    try:
        replies = app.control.ping(timeout=timeout, limit=1) or []
    except FileNotFoundError:   # the filesystem broker's control folder: made when a worker starts
        return []
    return sorted(node for reply in replies for node in reply)
