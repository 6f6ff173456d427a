"""How the server formats values as text: `number`, the one number formatter of the pages, reports
and exports, and `describe_event`, an event as one readable line (the report's event list, the
live page's event log). Pure: no database, no Django."""
from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

from trainer.run.controls import AUTOPILOT, SCHEDULE  # requested_by of the autopilot's, the schedule's

MISSING = "—"   # a figure a run does not have (summary tables, comparisons)
# the trainer's events that open a run's training (a start, a resume): they carry its sizes (`trains`)
RUN_STARTS = ("run_started", "run_resumed")


def number(v: int | float | bool, digits: int = 4, grouping: bool = False) -> str:
    """`v` to `digits` significant digits, never cutting its whole part (a magnitude of
    10**(digits-1) or more shows as a whole number), and without an exponent for ordinary
    magnitudes: 0.0002, 3e-05 -> 0.00003, 1234.5 -> 1234, 1e-07 -> 1e-7. `grouping`: thousands
    separators (1,234,567). Booleans as true/false; NaN, Infinity, -Infinity as JavaScript says them."""
    if isinstance(v, bool):
        return "true" if v else "false"
    f = float(v)
    if f != f:
        return "NaN"
    if f in (float("inf"), float("-inf")):
        return "Infinity" if f > 0 else "-Infinity"
    if abs(f) >= 10 ** (digits - 1):
        whole = v if isinstance(v, int) else round(f)
        return f"{whole:,}" if grouping else str(whole)
    g = float(f"{f:.{digits}g}")
    if g == int(g):
        return str(int(g))
    if abs(g) >= 1e-6:
        return format(Decimal(repr(g)), "f")
    return repr(g).replace("e-0", "e-")


def figure(v: Any) -> str:
    """A key figure in a table: a number grouped by thousands, MISSING for None, text as it is."""
    if v is None:
        return MISSING
    if isinstance(v, (int, float)):
        return number(v, grouping=True)
    return str(v)


def byte_size(n: int | float) -> str:
    """Bytes in binary units, 3 significant digits: 311296 -> "304 KiB", 5452595 -> "5.2 MiB",
    512 -> "512 bytes"."""
    n = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(round(n)) < 1024 or unit == "GiB":
            return f"{number(n, digits=3, grouping=True)} {unit}"
        n /= 1024
    return ""   # never reached


def trains(lora: dict | None, sizes: dict | None) -> str:
    """What a run trains, in words (the run and report pages): "LoRA r=8, α=16: 77,824 trainable
    parameters of 879,232 (8.9%), adapter 304 KiB", or "full fine-tuning: 879,232 parameters".
    `lora`: the config's [lora] section; `sizes`: the figures of the run's run_started /
    run_resumed event (trainable_params, total_params, adapter_bytes), None before it started
    (then only the kind of training: "LoRA r=8, α=16", "full fine-tuning")."""
    lora = lora if isinstance(lora, dict) else {}
    sizes = sizes if isinstance(sizes, dict) else {}
    rank = lora.get("rank") or 0
    trainable, total = sizes.get("trainable_params"), sizes.get("total_params")
    known = isinstance(trainable, int) and isinstance(total, int) and total > 0
    if not (isinstance(rank, int) and rank > 0):
        if not known:
            return "full fine-tuning"
        if trainable == total:
            return f"full fine-tuning: {number(total, grouping=True)} parameters"
        return (f"full fine-tuning: {number(trainable, grouping=True)} trainable parameters of "
                f"{number(total, grouping=True)}")
    alpha = lora.get("alpha")
    head = f"LoRA r={rank}" + (f", α={number(alpha)}" if isinstance(alpha, (int, float)) else "")
    if not known:
        return head
    text = (f"{head}: {number(trainable, grouping=True)} trainable parameters of "
            f"{number(total, grouping=True)} ({number(100.0 * trainable / total, digits=2)}%)")
    adapter = sizes.get("adapter_bytes")
    if isinstance(adapter, (int, float)) and adapter > 0:
        text += f", adapter {byte_size(adapter)}"
    return text


# --- events -------------------------------------------------------------------------------------



def value(v: Any) -> str:
    """A value inside an event line: a number (`number`), true/false, null, a list
    (pilot.autopilot: "[staleness, april]"), or the text itself."""
    if v is None:
        return "null"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(value(x) for x in v) + "]"
    if isinstance(v, (int, float)):
        return number(v)
    return str(v)


def pairs(d: dict, skip: tuple = ()) -> str:
    """Up to 8 of an event's fields as key=value (a nested value as JSON)."""
    return " ".join(f"{k}={json.dumps(v, default=str) if isinstance(v, (dict, list)) else value(v)}"
                    for k, v in list((k, v) for k, v in d.items() if k not in skip)[:8])


def changes(d: dict, sep: str = ": ") -> str:
    """A knob event's `changes` as "key: old → new, ..."."""
    out = []
    for k, ch in (d.get("changes") or {}).items():
        ch = ch if isinstance(ch, dict) else {}
        out.append(f"{k}{sep}{value(ch.get('old'))} → {value(ch.get('new'))}")
    return ", ".join(out)


def move(knob: Any, current: Any, proposed: Any) -> str:
    """A piece of advice's move: "async.max_staleness 0 → 1", or "no knob" (advice that is no knob)."""
    return f"{knob} {value(current)} → {value(proposed)}" if knob else "no knob"


def guard(g: Any) -> str:
    """The guard that undid an autopilot change, as text (a name, or a dict with its message)."""
    if isinstance(g, dict):
        return str(g.get("message") or g.get("name") or pairs(g))
    return "" if g is None else str(g)


def _applied(d: dict) -> str:
    """A knob_applied event as a line, saying when it came from the pilot's advice: the
    autopilot's changes and undos, a person's Apply."""
    reason = d.get("reason") if isinstance(d.get("reason"), dict) else {}
    if d.get("requested_by") == AUTOPILOT and reason.get("undo_of"):
        undone = changes(d, sep=" ")
        why = guard(reason.get("guard"))
        return f"autopilot undo: {undone}" + (f" (guard: {why})" if why else "")
    if d.get("requested_by") == AUTOPILOT and reason.get("rule"):
        why = f"{reason['rule']}: {reason['message']}" if reason.get("message") else str(reason["rule"])
        return f"autopilot: {changes(d, sep=' ')} ({why})"
    if d.get("requested_by") == SCHEDULE and reason.get("point"):   # async.staleness_schedule
        return f"{changes(d)} (by the schedule: point {reason['point']})"
    if reason.get("evidence_key") and reason.get("rule") and d.get("requested_by"):
        return f"{changes(d)} (by {d['requested_by']}, from {reason['rule']} advice)"
    by = f" (by {d['requested_by']})" if d.get("requested_by") else ""
    return changes(d) + by


def describe_event(kind: str, data: Any) -> str:
    """One readable line per event: "optim.lr: 0.0002 → 0.0001 (by alice)", "staleness: ...",
    "checkpoint path". The report's event list, and the live page's event log, which shows the
    `text` each event message carries (live/streams.event_message)."""
    d = data if isinstance(data, dict) else {}
    by = f" (by {d['requested_by']})" if d.get("requested_by") else ""
    if kind == "knob_applied":
        return _applied(d)
    if kind == "auto_staleness":
        return changes(d) + " (auto)"
    if kind == "knob_requested":
        advice = d.get("advice") if isinstance(d.get("advice"), dict) else {}
        if advice.get("rule") and d.get("requested_by"):
            by = f" (by {d['requested_by']}, from {advice['rule']} advice)"
        return ", ".join(f"{k} = {value(v)}" for k, v in (d.get("knobs") or {}).items()) + by
    if kind == "advice":
        return f"{d.get('rule') or 'pilot'}: {move(d.get('knob'), d.get('current'), d.get('proposed'))}" + (
            f" — {d['message']}" if d.get("message") else "")
    if kind == "advice_dismissed":
        return (f"dismissed {d.get('rule') or 'pilot'} advice: "
                f"{move(d.get('knob'), d.get('current'), d.get('proposed'))}" + by)
    if kind == "knob_rejected":
        return "; ".join(f"{k}: {v}" for k, v in (d.get("errors") or {}).items()) + by
    if kind in ("error", "warning", "run_interrupted"):
        return str(d.get("message") or pairs(d))
    if kind == "alert":
        return f"{d.get('rule') or 'alert'}: {d.get('message') or pairs(d, ('rule',))}"
    if kind == "alert_cleared":
        return f"{d.get('rule') or 'alert'} cleared"
    if kind == "checkpoint":
        return str(d.get("path") or pairs(d))
    if kind == "imported":   # a CLI run directory imported (actions/imports.py)
        return f"from {d.get('source')} (by {d.get('by')})"
    if kind == "forked":
        overrides = ", ".join(f"{k} = {value(v)}" for k, v in (d.get("overrides") or {}).items())
        return f"from run #{d.get('parent')} at step {d.get('step')}" + (f": {overrides}" if overrides else "") + by
    if kind == "status":
        return str(d.get("status", "")) + (f" — {d['message']}" if d.get("message") else "")
    if kind in RUN_STARTS and isinstance(d.get("devices"), dict):   # what each process holds
        held = ", ".join(f"{lane} ({x.get('count')} {x.get('kind')})" for lane, x in d["devices"].items()
                         if isinstance(x, dict))
        return f"{pairs(d, ('devices',))} devices={held}"
    return pairs(d)
