"""One past run's report (the report page; the JSON and HTML exports reuse it): its key figures
(`summary`, from its metric rows), its knob changes, events and alerts, the pilot's advice and what
came of it, and its checkpoints on disk. Reads only; nothing here writes rows."""
from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db.models import Avg, Count, Max, Sum
from django.utils import timezone

from trainer import config as config_mod
from trainer.rollout.ledger import REASONS as _WASTE
from trainer.run import checkpoint
from webapp.dashboard import formatting
from webapp.dashboard.actions import run_dir
from webapp.dashboard.models import MetricPoint, Run, RunEvent, Status
from webapp.dashboard.reports import cost

# (key, label, higher is better) -- the order of the summary table
SUMMARY = [
    ("steps", "steps", None),
    ("wall_time_s", "wall time running (s)", False),
    ("gen_tokens", "generated tokens", None),
    ("trained_tokens", "trained tokens", None),
    ("ledger_waiting", "generated tokens waiting at the last step (buffer, queue, in flight)", None),
    ("waste_version_span", "generated tokens dropped: version span (APRIL)", False),
    ("waste_stale", "generated tokens dropped: staler than η (async)", False),
    ("waste_zero_variance", "generated tokens dropped: zero-variance groups", False),
    ("waste_surplus", "generated tokens dropped: surplus groups", False),
    ("waste_aborted", "generated tokens dropped: aborted", False),
    ("waste_mismatch", "generated tokens dropped: masked by the mismatch correction", False),
    ("trained_token_share", "share of generated tokens trained", True),
    ("samples_generated", "samples generated", None),
    ("samples_skipped", "samples skipped (GRESO)", None),
    ("greso_warm_prompts", "prompts that started with GRESO history (warm start)", None),
    ("accuracy_final", "accuracy (final)", True),
    ("accuracy_best", "accuracy (best)", True),
    ("reward_final", "reward (final)", True),
    ("reward_best", "reward (best)", True),
    ("eval_accuracy_final", "eval accuracy (final)", True),
    ("eval_accuracy_best", "eval accuracy (best)", True),
    ("gen_tokens_per_s", "generated tokens/s (mean)", True),
    ("trained_tokens_per_s", "trained tokens/s (mean)", True),
    ("trained_tokens_per_train_s", "trained tokens/s (trained tokens / step time)", True),
    ("device_hours", "device-hours, every process (GPU-hours + CPU core-hours)", False),
    ("cost_price", "price (at the run's rates)", False),
    ("cost_idle_share", "share of the devices' time idle", False),
    ("gpu_util", "GPU utilisation % (mean)", True),
    ("cpu_util", "CPU utilisation % (mean, no GPU)", None),
    ("time_gen_s", "time: generation (s)", None),
    ("time_reward_s", "time: reward (s)", None),
    ("time_train_s", "time: training (s)", None),
    ("time_weight_sync_s", "time: weight sync (s)", None),
    ("time_gen_pct", "time: generation (%)", None),
    ("time_reward_pct", "time: reward (%)", None),
    ("time_train_pct", "time: training (%)", None),
    ("time_weight_sync_pct", "time: weight sync (%)", None),
]
LABELS = {k: label for k, label, _ in SUMMARY}

_KEYS = ["train/gen_tokens_total", "train/trained_tokens_total", "train/samples_total",
         "rollout/tokens/generated_total", "rollout/tokens/trained_total", "rollout/tokens/waiting",
         *(f"rollout/waste/{r}" for r in _WASTE),
         "rollout/gen_tokens", "rollout/trained_tokens", "rollout/samples", "reward/accuracy",
         "reward/mean", "eval/accuracy", "perf/gen_tokens_per_s", "perf/trained_tokens_per_s",
         "system/gpu_util", "system/cpu_util", "timing/gen_s", "timing/reward_s", "timing/train_s",
         "timing/weight_sync_s", "timing/step_s"]


def _last(run_id: int, key: str) -> float | None:
    return (MetricPoint.objects.filter(run_id=run_id, key=key, value__isnull=False)
            .order_by("-step", "-seq").values_list("value", flat=True).first())


def running_seconds(run: Run) -> float | None:
    """Seconds the run spent running or stopping, from its status events: time queued, paused,
    or stopped before a resume does not count, so a run resumed a day later compares with one
    that ran straight through. None before it first ran."""
    total, since, seen = 0.0, None, False
    for t, data in (RunEvent.objects.filter(run_id=run.pk, kind="status").order_by("seq")
                    .values_list("time", "data")):
        live = (data or {}).get("status") in (Status.RUNNING, Status.STOPPING)
        if live and since is None:
            since, seen = t, True
        elif not live and since is not None:
            total += (t - since).total_seconds()
            since = None
    if since is not None:   # still running (or its end was never recorded)
        total += ((run.finished_at or timezone.now()) - since).total_seconds()
    if not seen:
        return None
    return round(total, 3)


_READ = object()   # summary(): read the run's cost account itself


def summary(run: Run, account: dict[str, Any] | None | object = _READ) -> dict[str, Any]:
    """The report's key figures, computed from the run's rows (None where a metric is missing).
    `account`: the run's cost account when the caller has already read it (reports/cost.py)."""
    agg = {r["key"]: r for r in (MetricPoint.objects.filter(run_id=run.pk, key__in=_KEYS)
                                 .values("key").annotate(n=Count("value"), avg=Avg("value"),
                                                         mx=Max("value"), sm=Sum("value")))}

    def avg(k):
        return agg[k]["avg"] if k in agg and agg[k]["n"] else None

    def best(k):
        return agg[k]["mx"] if k in agg and agg[k]["n"] else None

    def total(k):
        return agg[k]["sm"] if k in agg and agg[k]["n"] else None

    def last(k):
        return _last(run.pk, k) if k in agg and agg[k]["n"] else None

    def cumulative(total_key, per_step_key):
        v = last(total_key)
        return v if v is not None else total(per_step_key)

    out: dict[str, Any] = {"steps": run.step, "wall_time_s": running_seconds(run)}
    out["gen_tokens"] = cumulative("train/gen_tokens_total", "rollout/gen_tokens")
    out["trained_tokens"] = cumulative("train/trained_tokens_total", "rollout/trained_tokens")
    # where the generated tokens went (the trainer's token ledger; runs before it have none)
    out["ledger_waiting"] = last("rollout/tokens/waiting")
    for r in _WASTE:
        out[f"waste_{r}"] = total(f"rollout/waste/{r}")
    generated, trained = last("rollout/tokens/generated_total"), last("rollout/tokens/trained_total")
    out["trained_token_share"] = trained / generated if generated and trained is not None else None
    out["samples_generated"] = cumulative("train/samples_total", "rollout/samples")
    sampled = dict(MetricPoint.objects.filter(run_id=run.pk, key="greso/prompts_sampled")
                   .values_list("step", "value"))
    skipped_prompts = None
    if sampled:
        rates = dict(MetricPoint.objects.filter(run_id=run.pk, key="greso/skip_rate")
                     .values_list("step", "value"))
        skipped_prompts = sum((sampled[s] or 0) * (rates.get(s) or 0) for s in sampled)
    n = ((run.config or {}).get("rollout") or {}).get("n_samples_per_prompt") or 1
    out["samples_skipped"] = round(skipped_prompts * n) if skipped_prompts is not None else None
    out["greso_warm_prompts"] = greso_warm_prompts(run)
    for name, key in (("accuracy", "reward/accuracy"), ("reward", "reward/mean"),
                      ("eval_accuracy", "eval/accuracy")):
        out[f"{name}_final"], out[f"{name}_best"] = last(key), best(key)
    out["gen_tokens_per_s"] = avg("perf/gen_tokens_per_s")
    out["trained_tokens_per_s"] = avg("perf/trained_tokens_per_s")
    step_s = total("timing/step_s")
    out["trained_tokens_per_train_s"] = (out["trained_tokens"] / step_s
                                         if out["trained_tokens"] is not None and step_s else None)
    out["gpu_util"] = avg("system/gpu_util")
    out["cpu_util"] = avg("system/cpu_util") if out["gpu_util"] is None else None
    if account is _READ:   # what its processes held, priced (docs/cost.md)
        account = cost.account(run)
    out["device_hours"] = sum(account["device_hours"].values()) if account else None
    out["cost_price"] = account["price"] if account else None
    out["cost_idle_share"] = account["idle_share"] if account else None
    parts = {p: total(f"timing/{p}_s") for p in ("gen", "reward", "train", "weight_sync")}
    whole = sum(v for v in parts.values() if v)
    for p, v in parts.items():
        out[f"time_{p}_s"] = v
        out[f"time_{p}_pct"] = 100.0 * v / whole if v is not None and whole else None
    return out


def summary_rows(s: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "label": label, "value": s.get(k), "text": formatting.figure(s.get(k))}
            for k, label, _ in SUMMARY if s.get(k) is not None]


# --- what trains --------------------------------------------------------------------------------

def training_sizes(run: Run) -> dict[str, Any] | None:
    """The data of the run's latest run_started / run_resumed event that carries what trains
    (trainable_params, total_params, adapter_bytes); None before the run started (or for a run
    recorded before the trainer reported them)."""
    for data in (RunEvent.objects.filter(run_id=run.pk, kind__in=formatting.RUN_STARTS)
                 .order_by("-seq").values_list("data", flat=True)):
        if isinstance(data, dict) and "trainable_params" in data:
            return data
    return None


def greso_warm_prompts(run: Run) -> int | None:
    """How many prompts the run took GRESO history for from another run (greso.warm_start: its
    run_started event says); None for a cold start."""
    data = (RunEvent.objects.filter(run_id=run.pk, kind="run_started").order_by("-seq")
            .values_list("data", flat=True).first())
    warm = data.get("greso_warm_start") if isinstance(data, dict) else None
    prompts = warm.get("prompts") if isinstance(warm, dict) else None
    return prompts if isinstance(prompts, int) and not isinstance(prompts, bool) else None


def sandbox_warning(run: Run) -> str | None:
    """The warning of a run that executes model-written code without the isolation boundary
    (sandbox.isolation = "process"), shown on its live page and report for as long as it exists;
    None otherwise (and for a config this trainer no longer reads)."""
    from trainer.sandbox.preflight import weak_isolation_warning
    try:
        cfg = config_mod.from_dict(run.config or {})
    except Exception:  # noqa: BLE001 -- an old or imported run's config: no claim either way
        return None
    return weak_isolation_warning(cfg)


def invariants(run: Run) -> dict[str, Any] | None:
    """The run's invariants for its pages (trainer/invariants/rules.py): {"broken": [{rule, step
    (the first), count (samples, summed), steps}]}, empty when all held; None when the run
    reported no invariants/* figure (checks off, or a run from before them): no claim."""
    if not MetricPoint.objects.filter(run_id=run.pk, key__startswith="invariants/").exists():
        return None
    broken: dict[str, dict[str, Any]] = {}
    for step, data in (RunEvent.objects.filter(run_id=run.pk, kind="invariant_violated")
                       .order_by("seq").values_list("step", "data")):
        d = data if isinstance(data, dict) else {}
        rule = str(d.get("rule") or "invariant")
        b = broken.setdefault(rule, {"rule": rule, "step": step, "count": 0, "steps": 0})
        b["count"] += d.get("count") if isinstance(d.get("count"), int) else 0
        b["steps"] += 1
    return {"broken": list(broken.values())}


def trains(run: Run) -> str:
    """What the run trains, in words (formatting.trains): LoRA's rank and alpha from its config,
    the figures from its latest start or resume."""
    return formatting.trains((run.config or {}).get("lora"), training_sizes(run))


# --- knobs, events, alerts ----------------------------------------------------------------------

def knob_timeline(run: Run) -> list[dict[str, Any]]:
    """Every applied knob change: who, old -> new, applied at which step."""
    out = []
    for e in RunEvent.objects.filter(run_id=run.pk, kind__in=("knob_applied", "auto_staleness")).order_by("seq"):
        d = e.data or {}
        who = d.get("requested_by") or ("auto (staleness controller)" if e.kind == "auto_staleness" else "")
        for key, ch in (d.get("changes") or {}).items():
            ch = ch if isinstance(ch, dict) else {}
            out.append({"step": e.step, "who": who, "key": key, "old": ch.get("old"), "new": ch.get("new"),
                        "time": e.time})
    return out


def event_rows(events) -> list[dict[str, Any]]:
    """RunEvent rows as the report's event list shows them."""
    return [{"step": e.step, "time": e.time, "kind": e.kind, "text": formatting.describe_event(e.kind, e.data)}
            for e in events]


def alerts(run: Run) -> list[dict[str, Any]]:
    return [{"step": e.step, "time": e.time, "kind": e.kind, "rule": (e.data or {}).get("rule", ""),
             "message": (e.data or {}).get("message", "")}
            for e in RunEvent.objects.filter(run_id=run.pk, kind__in=("alert", "alert_cleared")).order_by("seq")]


# --- the pilot's advice: advised, applied, dismissed, and what happened next -----------------------

EFFECT_STEPS = 10   # steps before and after an applied change whose means the report compares
EFFECT_METRICS = (("perf/trained_tokens_per_s", "trained tokens/s"),
                  (("reward/accuracy", "reward/mean"), "accuracy"))   # accuracy, else the reward


def _mean(run_id: int, key: str, first: int, last: int) -> tuple[float | None, int]:
    """(mean, steps) of `key` over steps first..last (a step's missing or NaN value left out)."""
    agg = (MetricPoint.objects.filter(run_id=run_id, key=key, step__gte=first, step__lte=last,
                                      value__isnull=False).aggregate(avg=Avg("value"), n=Count("step", distinct=True)))
    return agg["avg"], agg["n"]


def change_effect(run_id: int, step: int, steps: int = EFFECT_STEPS) -> list[dict[str, Any]]:
    """What happened after a knob change applied at `step` (it takes effect from step + 1): the
    mean of trained tokens/s and of the accuracy (else the reward) over up to `steps` steps up to
    `step` and over up to `steps` steps after it. One row per metric the run reported."""
    out = []
    for keys, label in EFFECT_METRICS:
        for key in (keys if isinstance(keys, tuple) else (keys,)):
            before, n_before = _mean(run_id, key, step - steps + 1, step)
            after, n_after = _mean(run_id, key, step + 1, step + steps)
            if n_before or n_after:
                break
        else:
            continue
        change = (after - before) / abs(before) if before and after is not None else None
        before_steps = f"{n_before} step{'s' * (n_before != 1)}"
        if after is None:
            text = f"{formatting.figure(before)} over the {before_steps} before; no step after it yet"
        elif before is None:
            text = f"{formatting.figure(after)} over the {n_after} step{'s' * (n_after != 1)} after; none before it"
        else:
            text = (f"{formatting.figure(before)} → {formatting.figure(after)}"
                    + (f" ({change:+.0%})" if change is not None else "")
                    + f", {before_steps} before and {n_after} after")
        out.append({"key": key, "label": label, "before": before, "after": after, "steps_before": n_before,
                    "steps_after": n_after, "change": change, "text": text})
    return out


def advice_history(run: Run) -> dict[str, list[dict[str, Any]]]:
    """The pilot on this run: what was advised when (`advice` events, the trainer's), what was
    applied (knob_applied events whose reason names a piece of advice: a person's Apply, the
    autopilot's changes and its undos) with what happened next (change_effect), and what was
    dismissed (`advice_dismissed`)."""
    advised, applied, dismissed = [], [], []
    messages: dict[str, str] = {}
    for e in (RunEvent.objects.filter(run_id=run.pk, kind__in=("advice", "knob_applied", "advice_dismissed"))
              .order_by("seq")):
        d = e.data if isinstance(e.data, dict) else {}
        if e.kind == "advice":
            if d.get("evidence_key") and d.get("message"):
                messages[str(d["evidence_key"])] = str(d["message"])
            advised.append({"step": e.step, "time": e.time, "rule": d.get("rule"), "reason": d.get("reason"),
                            "move": formatting.move(d.get("knob"), d.get("current"), d.get("proposed")),
                            "message": d.get("message") or "", "confidence": d.get("confidence") or "",
                            "evidence_key": d.get("evidence_key")})
        elif e.kind == "advice_dismissed":
            dismissed.append({"step": e.step, "time": e.time, "rule": d.get("rule"),
                              "move": formatting.move(d.get("knob"), d.get("current"), d.get("proposed")),
                              "message": d.get("message") or "", "by": d.get("requested_by") or "",
                              "evidence_key": d.get("evidence_key")})
        else:
            reason = d.get("reason") if isinstance(d.get("reason"), dict) else {}
            key = reason.get("evidence_key") or reason.get("undo_of")
            if not key:
                continue   # a change no advice asked for
            autopilot = d.get("requested_by") == formatting.AUTOPILOT
            undo = bool(reason.get("undo_of"))
            applied.append({
                "step": e.step, "time": e.time, "rule": reason.get("rule") or "", "evidence_key": str(key),
                "by": ("autopilot (undo)" if undo else "autopilot") if autopilot
                else f"{d.get('requested_by') or 'web'} (from advice)",
                "undo": undo, "guard": formatting.guard(reason.get("guard")) if undo else "",
                "changes": formatting.changes(d, sep=" "),
                "message": (reason.get("message") or messages.get(str(key))
                            or str(reason.get("reason") or "").replace("_", " ")),
                "effect": change_effect(run.pk, e.step)})
    return {"advised": advised, "applied": applied, "dismissed": dismissed}


# --- checkpoints on disk -------------------------------------------------------------------------

def checkpoints(run: Run) -> list[dict[str, Any]]:
    out = []
    for ck in checkpoint.list_checkpoints(run_dir(run.pk)):
        try:
            step = int(ck.name.rsplit("_", 1)[-1])
        except ValueError:
            continue
        size = sum(f.stat().st_size for f in ck.rglob("*") if f.is_file())
        out.append({"name": ck.name, "step": step, "path": str(ck), "size_mb": round(size / 2**20, 1),
                    "time": datetime.fromtimestamp(ck.stat().st_mtime, tz=timezone.get_current_timezone())})
    return out


def checkpoint_path(run: Run, step: int):
    for ck in checkpoints(run):
        if ck["step"] == step:
            return ck["path"]
    return None
