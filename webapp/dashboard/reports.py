"""Past-run reports: the summary of a run, its knob timeline, the pilot's advice and what came of
it, checkpoints, the comparison of runs (config diff, summaries with ratios) and the exports
(CSV, JSON, TOML, self-contained HTML).
Reads only; nothing here writes rows. A little over 400 lines: the summary, comparison and
exports share the same queries."""
from __future__ import annotations

import io
import json
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db.models import Avg, Count, Max, Sum
from django.template.loader import render_to_string
from django.utils import timezone

from trainer import config as config_mod
from trainer.rollout.ledger import REASONS as _WASTE
from trainer.run import checkpoint
from webapp.dashboard import inspector, streams
from webapp.dashboard import timeline as run_timeline
from webapp.dashboard.actions import run_dir
from webapp.dashboard.models import HistogramSnapshot, MetricPoint, RolloutSample, Run, RunEvent, Status
from webapp.dashboard.spreadsheet_safe import SafeWriter

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
    ("trained_token_share", "share of generated tokens trained", True),
    ("samples_generated", "samples generated", None),
    ("samples_skipped", "samples skipped (GRESO)", None),
    ("accuracy_final", "accuracy (final)", True),
    ("accuracy_best", "accuracy (best)", True),
    ("reward_final", "reward (final)", True),
    ("reward_best", "reward (best)", True),
    ("eval_accuracy_final", "eval accuracy (final)", True),
    ("eval_accuracy_best", "eval accuracy (best)", True),
    ("gen_tokens_per_s", "generated tokens/s (mean)", True),
    ("trained_tokens_per_s", "trained tokens/s (mean)", True),
    ("trained_tokens_per_train_s", "trained tokens/s (trained tokens / step time)", True),
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


def summary(run: Run) -> dict[str, Any]:
    """The report's key figures, computed from the run's rows (None where a metric is missing)."""
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
    parts = {p: total(f"timing/{p}_s") for p in ("gen", "reward", "train", "weight_sync")}
    whole = sum(v for v in parts.values() if v)
    for p, v in parts.items():
        out[f"time_{p}_s"] = v
        out[f"time_{p}_pct"] = 100.0 * v / whole if v is not None and whole else None
    return out


def fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != v:
            return "nan"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.4g}"
    return str(v)


def summary_rows(s: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "label": label, "value": s.get(k), "text": fmt(s.get(k))}
            for k, label, _ in SUMMARY if s.get(k) is not None]


# --- timeline, events, checkpoints --------------------------------------------------------------

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


def _num(v: Any) -> str:
    """A value as the live page's event log writes it (4 significant digits, no exponent for
    ordinary magnitudes: 0.0002, 3e-05 -> 0.00003, 1234567 -> 1235000, true/false)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (list, tuple)):   # a list knob (pilot.autopilot): "[staleness, april]"
        return "[" + ", ".join(_num(x) for x in v) + "]"
    if isinstance(v, (int, float)):
        f = float(v)
        if f != f or f in (float("inf"), float("-inf")):
            return "NaN" if f != f else ("Infinity" if f > 0 else "-Infinity")
        g = float(f"{f:.4g}")
        if g == int(g) and abs(g) < 1e21:
            return str(int(g))
        if abs(g) >= 1e-6:
            return format(Decimal(repr(g)), "f")
        return repr(g).replace("e-0", "e-")
    return str(v)


def _pairs(d: dict, skip: tuple = ()) -> str:
    return " ".join(f"{k}={json.dumps(v, default=str) if isinstance(v, (dict, list)) else _num(v)}"
                    for k, v in list((k, v) for k, v in d.items() if k not in skip)[:8])


def _changes(d: dict, sep: str = ": ") -> str:
    out = []
    for k, ch in (d.get("changes") or {}).items():
        ch = ch if isinstance(ch, dict) else {}
        out.append(f"{k}{sep}{_num(ch.get('old'))} → {_num(ch.get('new'))}")
    return ", ".join(out)


AUTOPILOT = "autopilot"   # requested_by of the autopilot's knob changes (trainer/pilot/)


def _move(knob: Any, current: Any, proposed: Any) -> str:
    """A piece of advice's move: "async.max_staleness 0 → 1", or "no knob" (advice that is no knob)."""
    return f"{knob} {_num(current)} → {_num(proposed)}" if knob else "no knob"


def _guard(g: Any) -> str:
    """The guard that undid an autopilot change, as text (a name, or a dict with its message)."""
    if isinstance(g, dict):
        return str(g.get("message") or g.get("name") or _pairs(g))
    return "" if g is None else str(g)


def _applied(d: dict) -> str:
    """A knob_applied event as a line, saying when it came from the pilot's advice: the
    autopilot's changes and undos, a person's Apply."""
    reason = d.get("reason") if isinstance(d.get("reason"), dict) else {}
    if d.get("requested_by") == AUTOPILOT and reason.get("undo_of"):
        changes = _changes(d, sep=" ")
        guard = _guard(reason.get("guard"))
        return f"autopilot undo: {changes}" + (f" (guard: {guard})" if guard else "")
    if d.get("requested_by") == AUTOPILOT and reason.get("rule"):
        why = f"{reason['rule']}: {reason['message']}" if reason.get("message") else str(reason["rule"])
        return f"autopilot: {_changes(d, sep=' ')} ({why})"
    if reason.get("evidence_key") and reason.get("rule") and d.get("requested_by"):
        return f"{_changes(d)} (by {d['requested_by']}, from {reason['rule']} advice)"
    by = f" (by {d['requested_by']})" if d.get("requested_by") else ""
    return _changes(d) + by


def describe_event(kind: str, data: Any) -> str:
    """One readable line per event, like the live page's event log (static/dashboard/run.js
    describe()): "optim.lr: 0.0002 → 0.0001 (by alice)", "staleness: ...", "checkpoint path"."""
    d = data if isinstance(data, dict) else {}
    by = f" (by {d['requested_by']})" if d.get("requested_by") else ""
    if kind == "knob_applied":
        return _applied(d)
    if kind == "auto_staleness":
        return _changes(d) + " (auto)"
    if kind == "knob_requested":
        advice = d.get("advice") if isinstance(d.get("advice"), dict) else {}
        if advice.get("rule") and d.get("requested_by"):
            by = f" (by {d['requested_by']}, from {advice['rule']} advice)"
        return ", ".join(f"{k} = {_num(v)}" for k, v in (d.get("knobs") or {}).items()) + by
    if kind == "advice":
        return f"{d.get('rule') or 'pilot'}: {_move(d.get('knob'), d.get('current'), d.get('proposed'))}" + (
            f" — {d['message']}" if d.get("message") else "")
    if kind == "advice_dismissed":
        return (f"dismissed {d.get('rule') or 'pilot'} advice: "
                f"{_move(d.get('knob'), d.get('current'), d.get('proposed'))}" + by)
    if kind == "knob_rejected":
        return "; ".join(f"{k}: {v}" for k, v in (d.get("errors") or {}).items()) + by
    if kind in ("error", "warning"):
        return str(d.get("message") or _pairs(d))
    if kind == "alert":
        return f"{d.get('rule') or 'alert'}: {d.get('message') or _pairs(d, ('rule',))}"
    if kind == "alert_cleared":
        return f"{d.get('rule') or 'alert'} cleared"
    if kind == "checkpoint":
        return str(d.get("path") or _pairs(d))
    if kind == "imported":   # a CLI run directory imported (actions/imports.py)
        return f"from {d.get('source')} (by {d.get('by')})"
    if kind == "forked":
        changes = ", ".join(f"{k} = {_num(v)}" for k, v in (d.get("overrides") or {}).items())
        return f"from run #{d.get('parent')} at step {d.get('step')}" + (f": {changes}" if changes else "") + by
    if kind == "status":
        return str(d.get("status", "")) + (f" — {d['message']}" if d.get("message") else "")
    return _pairs(d)


def event_rows(events) -> list[dict[str, Any]]:
    """RunEvent rows as the report's event list shows them."""
    return [{"step": e.step, "time": e.time, "kind": e.kind, "text": describe_event(e.kind, e.data)}
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
            text = f"{fmt(before)} over the {before_steps} before; no step after it yet"
        elif before is None:
            text = f"{fmt(after)} over the {n_after} step{'s' * (n_after != 1)} after; none before it"
        else:
            text = (f"{fmt(before)} → {fmt(after)}" + (f" ({change:+.0%})" if change is not None else "")
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
                            "move": _move(d.get("knob"), d.get("current"), d.get("proposed")),
                            "message": d.get("message") or "", "confidence": d.get("confidence") or "",
                            "evidence_key": d.get("evidence_key")})
        elif e.kind == "advice_dismissed":
            dismissed.append({"step": e.step, "time": e.time, "rule": d.get("rule"),
                              "move": _move(d.get("knob"), d.get("current"), d.get("proposed")),
                              "message": d.get("message") or "", "by": d.get("requested_by") or "",
                              "evidence_key": d.get("evidence_key")})
        else:
            reason = d.get("reason") if isinstance(d.get("reason"), dict) else {}
            key = reason.get("evidence_key") or reason.get("undo_of")
            if not key:
                continue   # a change no advice asked for
            autopilot = d.get("requested_by") == AUTOPILOT
            undo = bool(reason.get("undo_of"))
            applied.append({
                "step": e.step, "time": e.time, "rule": reason.get("rule") or "", "evidence_key": str(key),
                "by": ("autopilot (undo)" if undo else "autopilot") if autopilot
                else f"{d.get('requested_by') or 'web'} (from advice)",
                "undo": undo, "guard": _guard(reason.get("guard")) if undo else "",
                "changes": _changes(d, sep=" "),
                "message": (reason.get("message") or messages.get(str(key))
                            or str(reason.get("reason") or "").replace("_", " ")),
                "effect": change_effect(run.pk, e.step)})
    return {"advised": advised, "applied": applied, "dismissed": dismissed}


def _iso(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**r, "time": r["time"].isoformat()} for r in rows]


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


# --- comparison ---------------------------------------------------------------------------------

def flatten(config: dict) -> dict[str, Any]:
    return {f"{sec}.{k}": v for sec, values in (config or {}).items() if isinstance(values, dict)
            for k, v in values.items()}


def config_diff(runs: list[Run]) -> list[dict[str, Any]]:
    """Only the keys whose values differ between the runs (the launch config)."""
    flats = [flatten(r.config) for r in runs]
    keys = sorted(set().union(*flats)) if flats else []
    missing = object()
    out = []
    for k in keys:
        vals = [f.get(k, missing) for f in flats]
        if len({json.dumps(v, sort_keys=True, default=str) if v is not missing else "\0" for v in vals}) > 1:
            out.append({"key": k, "values": ["(absent)" if v is missing else v for v in vals]})
    return out


def ratio_text(v: Any, base: Any) -> str:
    if not isinstance(v, (int, float)) or not isinstance(base, (int, float)) or not base:
        return ""
    return f"{v / base:.2f}x"


def compare_rows(runs: list[Run], summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for key, label, better in SUMMARY:
        vals = [s.get(key) for s in summaries]
        if all(v is None for v in vals):
            continue
        base = vals[0]
        rows.append({"key": key, "label": label, "better": better,
                     "cells": [{"text": fmt(v), "ratio": ratio_text(v, base) if i else ""}
                               for i, v in enumerate(vals)]})
    return rows


HEADLINE_KEYS = ("trained_tokens_per_s", "gen_tokens_per_s", "accuracy_best", "wall_time_s")


def headlines(runs: list[Run], summaries: list[dict[str, Any]]) -> list[str]:
    """e.g. 'april vs sync: 1.42x trained tokens/s (mean)'"""
    out = []
    base = summaries[0]
    for r, s in zip(runs[1:], summaries[1:]):
        parts = [f"{ratio_text(s.get(k), base.get(k))} {LABELS[k]}" for k in HEADLINE_KEYS
                 if ratio_text(s.get(k), base.get(k))]
        if parts:
            out.append(f"{r.name} vs {runs[0].name}: " + ", ".join(parts))
    return out


# --- exports ------------------------------------------------------------------------------------

def all_points(run: Run):
    """Every point written, in order: (seq, step, key, value); NaN/inf are stored as NULL."""
    return (MetricPoint.objects.filter(run_id=run.pk).order_by("seq", "id")
            .values_list("seq", "step", "key", "value").iterator(chunk_size=5000))


def export_csv(run: Run) -> str:
    buf = io.StringIO()
    w = SafeWriter(buf)
    w.writerow(["seq", "step", "key", "value"])
    for seq, step, key, value in all_points(run):
        w.writerow([seq, step, key, "" if value is None else value])
    return buf.getvalue()


def full_series(run: Run) -> dict[str, dict[str, list]]:
    series: dict[str, dict[str, list]] = {}
    for _, step, key, value in all_points(run):
        s = series.setdefault(key, {"steps": [], "values": []})
        s["steps"].append(step)
        s["values"].append(value)
    return series


def run_meta(run: Run) -> dict[str, Any]:
    return {"id": run.pk, "name": run.name, "owner": run.owner.get_username(), "preset": run.preset,
            "status": run.status, "step": run.step, "max_steps": run.max_steps, "queue": run.queue,
            "worker_host": run.worker_host, "note": run.note, "tags": run.tags, "archived": run.archived,
            "created_at": run.created_at.isoformat(),
            "started_at": run.started_at.isoformat() if run.started_at else None,
            "finished_at": run.finished_at.isoformat() if run.finished_at else None,
            "error": run.error, "parent": run.parent_id, "fork_step": run.fork_step}


def export_json(run: Run) -> dict[str, Any]:
    return {"run": run_meta(run), "config": run.config, "knobs": run.knobs, "summary": summary(run),
            "trainer_summary": (run.summary or {}).get("final"),
            "metrics": full_series(run),
            "histograms": [{"step": h.step, "name": h.name, "edges": h.edges, "counts": h.counts}
                           for h in HistogramSnapshot.objects.filter(run_id=run.pk).order_by("seq")],
            "events": [{"seq": e.seq, "step": e.step, "kind": e.kind, "time": e.time.isoformat(),
                        "data": e.data} for e in RunEvent.objects.filter(run_id=run.pk).order_by("seq")],
            "knob_timeline": _iso(knob_timeline(run)),
            "advice": {part: _iso(rows) for part, rows in advice_history(run).items()},
            "timeline": [{"step": t["step"], "spans": t["spans"]}
                         for t in run_timeline.snapshot(run.pk)["slices"]],   # every step's spans
            # every sample but its per-token arrays (the samples CSV has those: they can be large)
            "samples": list(inspector.export_rows(run.pk, per_token=False))}


SAMPLE_COLUMNS = ["id", "seq", "step", "group", "index", "why", "finish", "length", "reward", "score",
                  "penalty", "advantage", "staleness", "tis_weight", "reward_status", "reward_error",
                  "segments", "prompt", "completion", "tokens", "logprobs"]
_JSON_COLUMNS = ("segments", "tokens", "logprobs")


def iter_samples_csv(run: Run):
    """The run's rollout samples as CSV lines, one row each (segments, tokens and
    log-probabilities as JSON; a missing number empty), produced as they are read."""
    buf = io.StringIO()
    w = SafeWriter(buf)
    w.writerow(SAMPLE_COLUMNS)
    for s in inspector.export_rows(run.pk):
        w.writerow([json.dumps(s[c], ensure_ascii=False) if c in _JSON_COLUMNS
                    else "" if s[c] is None else s[c] for c in SAMPLE_COLUMNS])
        yield buf.getvalue()
        buf.seek(0)
        buf.truncate()
    yield buf.getvalue()


def export_samples_csv(run: Run) -> str:
    return "".join(iter_samples_csv(run))


REPORT_SAMPLES = 1000       # samples in the offline HTML report's table (the latest)
REPORT_TEXT = 4000          # characters of a prompt or completion shown there


def report_samples(run: Run, limit: int = REPORT_SAMPLES) -> dict[str, Any]:
    """The offline report's sample table: the latest `limit` samples, texts shortened."""
    qs = RolloutSample.objects.filter(run_id=run.pk)
    rows = []
    for s in qs.order_by("-seq", "-id").defer("tokens", "logprobs")[:limit]:
        rows.append({"id": s.pk, "step": s.step, "group": s.group, "index": s.index, "length": s.length,
                     "reward": fmt(s.reward), "score": fmt(s.score), "finish": s.finish, "why": s.why,
                     "reward_status": s.reward_status, "reward_error": s.reward_error,
                     "staleness": s.staleness,
                     "versions": ", ".join(f"v{v}×{n}" for v, n in (s.segments or [])),
                     "prompt": s.prompt if len(s.prompt) <= REPORT_TEXT else s.prompt[:REPORT_TEXT] + "…",
                     "completion": (s.completion if len(s.completion) <= REPORT_TEXT
                                    else s.completion[:REPORT_TEXT] + "…")})
    rows.reverse()
    return {"rows": rows, "total": qs.count(), "limit": limit}


def export_toml(run: Run) -> str:
    head = (f"# rlpilot run {run.pk} {json.dumps(run.name)} ({run.status}): the launch config.\n"
            f"# Knob values at the end: {json.dumps(run.knobs, sort_keys=True)}\n")
    return head + config_mod.to_toml(config_mod.from_dict(run.config))


def _inline_script(text: str) -> str:
    return text.replace("</script", "<\\/script").replace("<!--", "<\\!--")


def export_html(run: Run, max_points: int = 2000) -> str:
    """One HTML file: Plotly, the chart code, the data and the tables inlined; no network."""
    static = settings.BASE_DIR / "static"
    snap = streams.metrics_snapshot(run, None, None, max_points, max_histograms=300, max_events=2000)
    return render_to_string("dashboard/report_export.html", {
        "run": run, "rows": summary_rows(summary(run)), "timeline": knob_timeline(run),
        "advice": advice_history(run),
        "alerts": alerts(run), "events": event_rows(RunEvent.objects.filter(run_id=run.pk).order_by("seq")[:2000]),
        "config_toml": export_toml(run), "generated": timezone.now(), "samples": report_samples(run),
        "css": (static / "dashboard" / "style.css").read_text(),
        "plotly_js": _inline_script((static / "vendor" / "plotly.min.js").read_text()),
        "charts_js": _inline_script((static / "dashboard" / "charts.js").read_text()),
        "timeline_js": _inline_script((static / "dashboard" / "timeline.js").read_text()),
        "timeline_data": run_timeline.snapshot(run.pk, max_slices=150),
        "data": {"points": snap["points"], "histograms": snap["histograms"],
                 "events": snap["events"], "config": run.config, "knobs": run.knobs},
    })
