"""Alert rules, evaluated on a run's rows as the database sink writes them.

`Monitor.check(records)` looks at a batch of records (scalars per step and events, with the
trainer's raw values: NaN may arrive as a float or as the string "nan"; the database stores
non-finite values as NULL) and returns `alert` / `alert_cleared` event records to append in the
same transaction, plus the run's new alert state. A rule raises once when its condition starts
and again only after it has cleared. The heartbeat rule is raised by `actions.mark_stale_runs`.

Rules (thresholds are settings, `RLPILOT_ALERT_*`):
  staleness      async/staleness/max > async/max_staleness (eta)
  kl_high        actor/kl > ALERT_KL_MAX
  kl_rising      actor/kl rose faster than ALERT_KL_RISE_PER_STEP per step over the window
  reward_collapse rollout/zero_var_ratio/all_wrong >= ALERT_COLLAPSE_RATIO for ALERT_COLLAPSE_STEPS steps
  nan_loss       actor/pg_loss non-finite, or a trainer `warning` event about a non-finite update
  heartbeat      no heartbeat for RLPILOT_HEARTBEAT_TIMEOUT_S (the run becomes interrupted)
"""
from __future__ import annotations

import math
from typing import Any

from django.conf import settings

from webapp.dashboard.actions import Record

RULES = ("staleness", "kl_high", "kl_rising", "reward_collapse", "nan_loss", "heartbeat")


def number(v: Any) -> float | None:
    """A metric value as a float (NaN/inf kept); None when it is not a number at all."""
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            return None
    return None


def non_finite(v: Any) -> bool:
    """NaN/inf as a float or a string ("nan", "inf", "-inf"), or a missing (NULL) value."""
    f = number(v)
    return f is None or not math.isfinite(f)


def alert_record(step: int, rule: str, message: str, **data) -> Record:
    return Record("event", step, "alert", {"rule": rule, "message": message, **data})


class Monitor:
    """Per-run alert state. `state` is the run's `alerts` JSON ({"active": {...}, "state": {...}}),
    so a resumed run (a new worker process) continues where the last one left off."""

    def __init__(self, state: dict | None = None):
        state = dict(state or {})
        self.active: dict[str, dict] = dict(state.get("active") or {})
        self.mem: dict[str, Any] = dict(state.get("state") or {})

    def as_json(self) -> dict:
        return {"active": self.active, "state": self.mem}

    # --- the rules ---------------------------------------------------------------------------
    def check(self, records: list[Record]) -> list[Record]:
        out: list[Record] = []
        for r in records:
            if r.kind == "points":
                out += self._points(r.step, r.values)
            elif r.kind == "event" and r.name == "warning":
                msg = str((r.values or {}).get("message", ""))
                if "non-finite" in msg.lower() or "nan" in msg.lower().split():
                    out += self._set("nan_loss", True, r.step, f"the trainer reported: {msg}")
        return out

    def _points(self, step: int, v: dict[str, Any]) -> list[Record]:
        out: list[Record] = []
        if "async/max_staleness" in v and number(v["async/max_staleness"]) is not None:
            self.mem["eta"] = number(v["async/max_staleness"])
        if "async/staleness/max" in v and self.mem.get("eta") is not None:
            s = number(v["async/staleness/max"])
            eta = self.mem["eta"]
            if s is not None and math.isfinite(s):
                out += self._set("staleness", s > eta, step,
                                 f"staleness {s:g} is above the bound η = {eta:g}", value=s, threshold=eta)
        if "actor/kl" in v:
            kl = number(v["actor/kl"])
            if kl is not None and math.isfinite(kl):
                kmax = settings.ALERT_KL_MAX
                out += self._set("kl_high", kl > kmax, step, f"KL {kl:.4g} is above {kmax:g}",
                                 value=kl, threshold=kmax)
                hist = [h for h in self.mem.get("kl", []) if h[0] < step] + [[step, kl]]
                window = max(1, settings.ALERT_KL_RISE_WINDOW)
                hist = hist[-(window + 1):]
                self.mem["kl"] = hist
                if len(hist) == window + 1:
                    (s0, k0), (s1, k1) = hist[0], hist[-1]
                    slope = (k1 - k0) / max(1, s1 - s0)
                    rise = settings.ALERT_KL_RISE_PER_STEP
                    out += self._set("kl_rising", slope > rise, step,
                                     f"KL is rising {slope:.4g} per step over the last {window} steps "
                                     f"(limit {rise:g})", value=slope, threshold=rise)
        if "rollout/zero_var_ratio/all_wrong" in v:
            w = number(v["rollout/zero_var_ratio/all_wrong"])
            if w is not None and math.isfinite(w):
                n = self.mem.get("all_wrong_steps", 0) + 1 if w >= settings.ALERT_COLLAPSE_RATIO else 0
                self.mem["all_wrong_steps"] = n
                need = max(1, settings.ALERT_COLLAPSE_STEPS)
                out += self._set("reward_collapse", n >= need, step,
                                 f"reward collapse: {w:.0%} of groups all wrong for {n} steps",
                                 value=w, threshold=settings.ALERT_COLLAPSE_RATIO)
        if "actor/pg_loss" in v:
            bad = non_finite(v["actor/pg_loss"])
            out += self._set("nan_loss", bad, step, f"non-finite loss: actor/pg_loss = {v['actor/pg_loss']}")
        return out

    def _set(self, rule: str, on: bool, step: int, message: str, **data) -> list[Record]:
        """Raise once when the condition starts; clear when it ends (then it may raise again)."""
        if on and rule not in self.active:
            clean = {k: (x if math.isfinite(x) else str(x)) if isinstance(x, float) else x
                     for k, x in data.items()}
            self.active[rule] = {"message": message, "step": step}
            return [alert_record(step, rule, message, **clean)]
        if not on and rule in self.active:
            del self.active[rule]
            return [Record("event", step, "alert_cleared", {"rule": rule})]
        return []


def heartbeat_alert(run, step: int) -> tuple[Record, dict]:
    """The `heartbeat` alert for a run whose worker disappeared, and its new alert state."""
    mon = Monitor(run.alerts)
    msg = f"no heartbeat for {settings.HEARTBEAT_TIMEOUT_S:g} s: the run is marked interrupted"
    mon.active["heartbeat"] = {"message": msg, "step": step}
    return alert_record(step, "heartbeat", msg, timeout_s=settings.HEARTBEAT_TIMEOUT_S), mon.as_json()
