"""GET /metrics: what Prometheus scrapes, read from the database (and the broker and the cache)
at every request.

`read_snapshot()` gathers the figures; `DashboardCollector` turns one snapshot into gauges for a
CollectorRegistry made for that one request, so no metric state outlives a scrape or leaks
between processes or tests. Stream delay (bench_stream measures it offline) is not measured by
the running app, so it is not here."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from datetime import datetime

from django.conf import settings
from django.db.models import Count, OuterRef, Subquery
from django.utils import timezone
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

from webapp.dashboard import lifecycle
from webapp.dashboard.models import MetricPoint, Run
from webapp.dashboard.monitoring import broker, sockets
from webapp.dashboard.reports.cost import priced_hours, rates

log = logging.getLogger(__name__)

GIB = 2 ** 30   # the trainer reports memory in GB of 2**30 bytes (trainer/observe/system.py)

# (Prometheus gauge, the trainer's metric (trainer/observe/metric_names.py), help, factor): a live run's
# latest value of each, labelled by the run
RUN_FIGURES: tuple[tuple[str, str, str, float], ...] = (
    ("rlpilot_run_reward_mean", "reward/mean", "Mean reward of the latest step's samples", 1),
    ("rlpilot_run_reward_accuracy", "reward/accuracy", "Share of the latest step's samples with full marks", 1),
    ("rlpilot_run_eval_accuracy", "eval/accuracy", "Held-out accuracy of the latest evaluation", 1),
    ("rlpilot_run_kl", "actor/kl", "k3 KL to the reference policy, latest step", 1),
    ("rlpilot_run_generated_tokens_per_second", "perf/gen_tokens_per_s",
     "Tokens generated per second of generation, latest step", 1),
    ("rlpilot_run_trained_tokens_per_second", "perf/trained_tokens_per_s",
     "Tokens trained on per second of step, latest step", 1),
    ("rlpilot_run_step_duration_seconds", "timing/step_s", "Duration of the latest step", 1),
    ("rlpilot_run_staleness_mean", "async/staleness/mean",
     "Policy versions behind, mean over the latest step's trained samples (asynchronous runs)", 1),
    ("rlpilot_run_staleness_max", "async/staleness/max",
     "Policy versions behind, max over the latest step's trained samples (asynchronous runs)", 1),
    ("rlpilot_run_response_length_mean_tokens", "rollout/response_len/mean",
     "Mean response length of the latest step", 1),
    ("rlpilot_run_zero_variance_ratio", "rollout/zero_var_ratio",
     "Share of the latest step's groups whose rewards are all equal", 1),
    ("rlpilot_run_gpu_utilization_percent", "system/gpu_util", "GPU utilisation, mean over the run's devices", 1),
    ("rlpilot_run_gpu_memory_used_bytes", "system/gpu_mem_gb", "GPU memory used, mean over the run's devices", GIB),
    ("rlpilot_run_cpu_utilization_percent", "system/cpu_util", "CPU utilisation (% of all cores; runs without a GPU)",
     1),
    ("rlpilot_run_memory_rss_bytes", "system/ram_gb", "Trainer resident memory (runs without a GPU)", GIB),
    ("rlpilot_run_gpu_hours", "cost/gpu_hours", "GPU-hours the run's processes have held so far", 1),
    ("rlpilot_run_cpu_core_hours", "cost/cpu_core_hours",
     "CPU core-hours the run's processes have held so far (runs without a GPU)", 1),
)

RUN_LABELS = ("run_id", "name", "preset", "owner")


@dataclass
class LiveRun:
    labels: tuple[str, str, str, str]    # RUN_LABELS
    status: str
    step: int
    max_steps: int
    heartbeat_age_s: float | None
    worker: str                          # the Celery node (worker_host without its pid)
    figures: dict[str, float] = field(default_factory=dict)   # trainer metric -> latest value
    price: float | None = None           # so far, at the run's rates; None: no rate, or no hours yet


@dataclass
class Snapshot:
    runs_by_status: dict[str, int]
    live_runs: list[LiveRun]
    queue_lengths: dict[str, int] | None          # None: the broker did not answer
    websocket_clients: dict[str, int] | None      # per web process; None: the cache did not answer


def worker_node(worker_host: str) -> str:
    """"gpu-h200@host7:4242" -> "gpu-h200@host7" (tasks.execute appends the process id)."""
    node, sep, pid = worker_host.rpartition(":")
    return node if sep and pid.isdigit() else worker_host


def read_live_runs(now: datetime) -> list[LiveRun]:
    """Live runs (running, paused, stopping) with their latest figures: two queries, each figure
    the newest point of its key (the (run, key, step) index)."""
    keys = [key for _, key, _, _ in RUN_FIGURES]
    latest = {f"point_{i}": Subquery(MetricPoint.objects.filter(run=OuterRef("pk"), key=key)
                                     .order_by("-step", "-seq").values("pk")[:1])
              for i, key in enumerate(keys)}
    rows = list(Run.objects.filter(status__in=lifecycle.LIVE).select_related("owner")
                .annotate(**latest).order_by("pk"))
    point_ids = [pid for r in rows for i in range(len(keys)) if (pid := getattr(r, f"point_{i}")) is not None]
    values = dict(MetricPoint.objects.filter(pk__in=point_ids).values_list("pk", "value"))
    out = []
    for r in rows:
        figures = {}
        for i, key in enumerate(keys):
            pid = getattr(r, f"point_{i}")
            if pid is not None:   # a NULL value is a NaN or infinity the trainer reported
                value = values.get(pid)
                figures[key] = math.nan if value is None else value
        age = (now - r.heartbeat_at).total_seconds() if r.heartbeat_at else None
        # the price gauge: the hours at the run's rates (its [cost] knobs, else RLPILOT_RATE_*)
        paid = priced_hours(figures, rates(r))
        out.append(LiveRun(labels=(str(r.pk), r.name, r.preset, r.owner.get_username()), status=r.status,
                           step=r.step, max_steps=r.max_steps, heartbeat_age_s=age,
                           worker=worker_node(r.worker_host), figures=figures,
                           price=paid["price"] if paid else None))
    return out


def read_snapshot() -> Snapshot:
    counts = dict.fromkeys(lifecycle.STATUSES, 0)
    counts.update(Run.objects.order_by().values_list("status").annotate(n=Count("pk")))
    try:
        queues = broker.queue_lengths(broker.watched_queues())
    except Exception as e:
        log.warning("/metrics: the Celery broker did not answer (%s: %s)", type(e).__name__, e)
        queues = None
    try:
        clients = sockets.counts()
    except Exception as e:
        log.warning("/metrics: the cache did not answer (%s: %s)", type(e).__name__, e)
        clients = None
    return Snapshot(runs_by_status=counts, live_runs=read_live_runs(timezone.now()),
                    queue_lengths=queues, websocket_clients=clients)


class DashboardCollector:
    """prometheus_client's custom-collector protocol: collect() yields the snapshot's gauges."""

    def __init__(self, snapshot: Snapshot):
        self.snapshot = snapshot

    def collect(self):
        s = self.snapshot
        runs = GaugeMetricFamily("rlpilot_runs", "Runs by status", labels=["status"])
        for status, n in s.runs_by_status.items():
            runs.add_metric([status], n)
        yield runs

        yield GaugeMetricFamily("rlpilot_broker_up", "1 when the Celery broker answered this scrape",
                                value=0 if s.queue_lengths is None else 1)
        queues = GaugeMetricFamily("rlpilot_celery_queue_length", "Tasks waiting in a Celery queue",
                                   labels=["queue"])
        for queue, n in (s.queue_lengths or {}).items():
            queues.add_metric([queue], n)
        yield queues

        yield from self._workers()

        yield GaugeMetricFamily("rlpilot_cache_up", "1 when the cache holding the WebSocket counts answered",
                                value=0 if s.websocket_clients is None else 1)
        clients = GaugeMetricFamily("rlpilot_websocket_clients", "WebSocket clients connected to a web process",
                                    labels=["process"])
        for process, n in (s.websocket_clients or {}).items():
            clients.add_metric([process], n)
        yield clients

        yield from self._runs()

    def _workers(self):
        ages: dict[str, float] = {}
        for run in self.snapshot.live_runs:
            if run.heartbeat_age_s is not None and run.worker:
                ages[run.worker] = min(run.heartbeat_age_s, ages.get(run.worker, math.inf))
        age = GaugeMetricFamily("rlpilot_worker_heartbeat_age_seconds",
                                "Seconds since a worker last beat for one of its live runs", labels=["worker"])
        for worker, seconds in sorted(ages.items()):
            age.add_metric([worker], seconds)
        yield age
        yield GaugeMetricFamily(
            "rlpilot_workers_seen", "Workers whose live runs beat within RLPILOT_HEARTBEAT_TIMEOUT_S",
            value=sum(1 for seconds in ages.values() if seconds <= settings.HEARTBEAT_TIMEOUT_S))

    def _runs(self):
        labels = list(RUN_LABELS)
        step = GaugeMetricFamily("rlpilot_run_step", "A live run's latest step", labels=labels)
        max_steps = GaugeMetricFamily("rlpilot_run_max_steps", "A live run's planned steps", labels=labels)
        heartbeat = GaugeMetricFamily("rlpilot_run_heartbeat_age_seconds",
                                      "Seconds since a live run's worker last beat", labels=labels)
        status = GaugeMetricFamily("rlpilot_run_status", "1 for a live run's status (running, paused, stopping)",
                                   labels=labels + ["status"])
        figures = {key: GaugeMetricFamily(name, text, labels=labels) for name, key, text, _ in RUN_FIGURES}
        factors = {key: factor for _, key, _, factor in RUN_FIGURES}
        for run in self.snapshot.live_runs:
            step.add_metric(run.labels, run.step)
            max_steps.add_metric(run.labels, run.max_steps)
            status.add_metric([*run.labels, run.status], 1)
            if run.heartbeat_age_s is not None:
                heartbeat.add_metric(run.labels, run.heartbeat_age_s)
            for key, value in run.figures.items():
                figures[key].add_metric(run.labels, value * factors[key])
        price = GaugeMetricFamily("rlpilot_run_price", "A live run's price so far: its device-hours at its "
                                  "rates (cost.gpu_hour / cost.cpu_core_hour, else RLPILOT_RATE_*)", labels=labels)
        for run in self.snapshot.live_runs:
            if run.price is not None:
                price.add_metric(run.labels, run.price)
        yield from (step, max_steps, heartbeat, status)
        yield from figures.values()
        yield price


def render(snapshot: Snapshot, accept: str | None) -> tuple[bytes, str]:
    """(the snapshot in the format the scraper's Accept header asks for -- the Prometheus text
    format, or OpenMetrics --, its content type), through a registry of its own."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DashboardCollector(snapshot))
    encode, content_type = choose_encoder(accept or "")
    return encode(registry), content_type
