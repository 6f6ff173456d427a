"""Alert rules, evaluated on a run's rows as the database sink writes them.

`Monitor.check(records)` looks at a batch of records (scalars per step and events, with the
trainer's raw values: NaN may arrive as a float or as the string "nan"; the database stores
non-finite values as NULL) and returns `alert` / `alert_cleared` event records to append in the
same transaction, plus the run's new alert state. A rule raises once when its condition starts
and again only after it has cleared, which takes ALERT_CLEAR_STEPS steps in a row without it.
The heartbeat rule is raised by the stale-run sweep
(`sweep.mark_stale_runs`, which hands `heartbeat_alert` to `actions.interrupt_lost_run`).

This module imports the actions layer (its records, and `actions.change_alerts` for StallWatch's
writes); the actions layer never imports it.

Rules (thresholds are settings, `RLPILOT_ALERT_*`):
  staleness      async/staleness/max > async/max_staleness (eta)
  kl_high        actor/kl > ALERT_KL_MAX for ALERT_KL_HIGH_STEPS steps in a row
  kl_rising      the median of actor/kl over the last ALERT_KL_RISE_WINDOW steps is at least
                 ALERT_KL_RISE_FACTOR x its median over the window before, and at least
                 ALERT_KL_RISE_MIN (trainer/pilot/window.py kl_rising, the pilot's KL rule too)
  mismatch_high  mismatch/kl (mismatch/age0/kl where reported by age: no policy drift) >
                 ALERT_MISMATCH_KL_MAX, or mismatch/outside_band_ratio > ALERT_MISMATCH_OUTSIDE_MAX:
                 the engine's log-probabilities far from the trainer's
                 (trainer/algo/rollout_correction.py; a bf16 engine's healthy mismatch stays under)
  reward_collapse rollout/zero_var_ratio/all_wrong >= ALERT_COLLAPSE_RATIO for ALERT_COLLAPSE_STEPS
                 steps, once the run has had a step under that ratio (something to collapse from)
  invariant      a step broke one of the run's invariants (invariants/<rule> > 0: a token beyond
                 eta or the version span, a sample trained twice, environment tokens carrying
                 loss, a prompt skipped or repeated, an engine not on the weights just sent;
                 trainer/invariants/); cleared after
                 ALERT_CLEAR_STEPS healthy steps
  nan_loss       actor/pg_loss non-finite, or a trainer `warning` event about a non-finite update
  single_turn    the trainer's `single_turn_episodes` event: a multi-turn run (episode.max_turns > 1)
                 whose episodes all had one model turn for several steps in a row, with the reason
                 (trainer/pilot/episodes.py); cleared by steps with a longer episode
  heartbeat      no heartbeat for RLPILOT_HEARTBEAT_TIMEOUT_S (the run becomes interrupted)
  stalled        no step finished for max(ALERT_STALL_FACTOR x median step time, ALERT_STALL_MIN_S)
                 while running (an evaluation or checkpoint between steps holds the clock, up to
                 ALERT_STALL_PHASE_MAX_S); evaluated by the worker's heartbeat thread
                 (StallWatch), which keeps going while the trainer is stuck and writes nothing
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

from django.conf import settings

from trainer.invariants import RULES as INVARIANT_RULES
from trainer.pilot.episodes import EVENT as SINGLE_TURN_EVENT
from trainer.pilot.window import kl_rising, median_halves
from webapp.dashboard import actions
from webapp.dashboard.actions import Record
from webapp.dashboard.models import MetricPoint, Run, Status

RULES = ("staleness", "kl_high", "kl_rising", "mismatch_high", "reward_collapse", "invariant", "nan_loss",
         "heartbeat", "stalled", "single_turn")
# rules raised and cleared by someone else than the sink's Monitor (which must not write back a
# stale copy of them): `stalled` by the heartbeat thread's StallWatch
EXTERNAL_RULES = ("stalled",)


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
        self.active: dict[str, dict] = {rule: a for rule, a in (state.get("active") or {}).items()
                                        if rule not in EXTERNAL_RULES}
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
            elif r.kind == "event" and r.name == SINGLE_TURN_EVENT:
                out += self._set("single_turn", True, r.step, str((r.values or {}).get("message", "")))
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
                # one step's estimate is noisy (a healthy run's spikes reach ~2.5x its level);
                # a runaway stays up
                n = self.mem.get("kl_high_steps", 0) + 1 if kl > kmax else 0
                self.mem["kl_high_steps"] = n
                need = max(1, settings.ALERT_KL_HIGH_STEPS)
                out += self._set("kl_high", n >= need, step,
                                 f"KL {kl:.4g} is above {kmax:g}" + (f" for {n} steps" if n > 1 else ""),
                                 value=kl, threshold=kmax)
                window = max(2, settings.ALERT_KL_RISE_WINDOW)
                hist = [h for h in self.mem.get("kl", []) if h[0] < step] + [[step, kl]]
                hist = hist[-2 * window:]
                self.mem["kl"] = hist
                if len(hist) == 2 * window:
                    # medians of two windows: a learning policy's KL rises too (a 5-step slope
                    # raised 38 alerts on a healthy 400-step run), a runaway doubles
                    factor, floor = settings.ALERT_KL_RISE_FACTOR, settings.ALERT_KL_RISE_MIN
                    rise = kl_rising([h[1] for h in hist], factor, floor)
                    before, recent = median_halves([h[1] for h in hist])
                    out += self._set("kl_rising", rise is not None, step,
                                     f"KL is rising: median {before:.3g} over steps {hist[0][0]}-"
                                     f"{hist[window - 1][0]}, {recent:.3g} over steps {hist[window][0]}-"
                                     f"{step} (x{factor:g} from {floor:g} up raises this)",
                                     value=recent, before=before, threshold=factor)
        out += self._mismatch(step, v)
        turns = number(v.get("episode/turns/max"))
        if turns is not None and turns > 1:   # episodes of several turns again
            out += self._set("single_turn", False, step, "")
        out += self._invariants(step, v)
        if "rollout/zero_var_ratio/all_wrong" in v:
            w = number(v["rollout/zero_var_ratio/all_wrong"])
            if w is not None and math.isfinite(w):
                # a collapse needs something to collapse from: a run that has not yet had a step
                # with signal (a model still learning the answer format) is not collapsing
                if w < settings.ALERT_COLLAPSE_RATIO:
                    self.mem["had_signal"] = True
                low = w >= settings.ALERT_COLLAPSE_RATIO and self.mem.get("had_signal", False)
                n = self.mem.get("all_wrong_steps", 0) + 1 if low else 0
                self.mem["all_wrong_steps"] = n
                need = max(1, settings.ALERT_COLLAPSE_STEPS)
                out += self._set("reward_collapse", n >= need, step,
                                 f"reward collapse: {w:.0%} of groups all wrong for {n} steps",
                                 value=w, threshold=settings.ALERT_COLLAPSE_RATIO)
        if "actor/pg_loss" in v:
            bad = non_finite(v["actor/pg_loss"])
            out += self._set("nan_loss", bad, step, f"non-finite loss: actor/pg_loss = {v['actor/pg_loss']}")
        return out

    def _mismatch(self, step: int, v: dict[str, Any]) -> list[Record]:
        """mismatch_high: either figure of the step past its maximum (both are in one step's row;
        a step with neither, e.g. mismatch.measure off, changes nothing). The KL is the engine's
        own: in a run that reports it by token age (asynchronous, APRIL) mismatch/kl adds the
        policy's drift since stale tokens were sampled (a healthy tiny async run measured 0.012),
        so there it is the age-0 tokens' (mismatch/age0/kl; a step without any reads no KL), and
        the share outside the band, which has no age split, is not read (the pilot's rule too)."""
        if any(k.startswith("mismatch/age") for k in v):
            self.mem["mismatch_by_age"] = True
        by_age = self.mem.get("mismatch_by_age")
        kl_key = "mismatch/age0/kl" if by_age else "mismatch/kl"
        checks = [(kl_key, settings.ALERT_MISMATCH_KL_MAX,
                   lambda x, m: f"engine vs trainer KL ({kl_key}) {x:.4g} is above {m:g}")]
        if not by_age:
            checks.append(("mismatch/outside_band_ratio", settings.ALERT_MISMATCH_OUTSIDE_MAX,
                           lambda x, m: f"{x:.1%} of tokens have pi_old / pi_rollout outside the "
                                        f"mismatch band (above {m:.1%})"))
        seen, over = False, []
        for key, most, text in checks:
            x = number(v.get(key))
            if x is None or not math.isfinite(x):
                continue
            seen = True
            if x > most:
                over.append((key, x, most, text(x, most)))
        if not seen:
            return []
        if not over:
            return self._set("mismatch_high", False, step, "")
        key, x, most, _ = over[0]
        return self._set("mismatch_high", True, step, "; ".join(o[3] for o in over),
                         key=key, value=x, threshold=most)

    def _invariants(self, step: int, v: dict[str, Any]) -> list[Record]:
        """invariant: any invariants/<rule> of the step above 0 (a step without them, e.g.
        run.check_invariants off, changes nothing)."""
        counts = {rule: number(v[f"invariants/{rule}"]) for rule in INVARIANT_RULES
                  if f"invariants/{rule}" in v}
        if not counts:
            return []
        broken = {rule: n for rule, n in counts.items() if n is not None and n > 0}
        if not broken:
            return self._set("invariant", False, step, "")
        said = ", ".join(f"{rule} ({n:g} sample{'s' if n != 1 else ''})" for rule, n in broken.items())
        return self._set("invariant", True, step, f"invariant broken at step {step}: {said}",
                         rules=sorted(broken), count=sum(broken.values()))

    def _set(self, rule: str, on: bool, step: int, message: str, **data) -> list[Record]:
        """Raise once when the condition starts; clear once it has been false for
        ALERT_CLEAR_STEPS steps in a row (then it may raise again). The hysteresis keeps a value
        that hovers at a threshold from raising and clearing every other step (as
        Prometheus' keep_firing_for)."""
        off_key = f"off_steps:{rule}"
        if on:
            self.mem.pop(off_key, None)
            if rule in self.active:
                return []
            clean = {k: (x if math.isfinite(x) else str(x)) if isinstance(x, float) else x
                     for k, x in data.items()}
            self.active[rule] = {"message": message, "step": step}
            return [alert_record(step, rule, message, **clean)]
        if rule not in self.active:
            return []
        off = self.mem.get(off_key, 0) + 1
        if off < max(1, settings.ALERT_CLEAR_STEPS):
            self.mem[off_key] = off
            return []
        self.mem.pop(off_key, None)
        del self.active[rule]
        return [Record("event", step, "alert_cleared", {"rule": rule})]


def heartbeat_alert(run, step: int) -> tuple[Record, dict]:
    """The `heartbeat` alert for a run whose worker disappeared, and its new alert state."""
    mon = Monitor(run.alerts)
    msg = f"no heartbeat for {settings.HEARTBEAT_TIMEOUT_S:g} s: the run is marked interrupted"
    mon.active["heartbeat"] = {"message": msg, "step": step}
    return alert_record(step, "heartbeat", msg, timeout_s=settings.HEARTBEAT_TIMEOUT_S), mon.as_json()


class StallWatch:
    """The `stalled` rule. The worker's Heartbeat thread calls tick() every few seconds; it keeps
    running while the trainer is deadlocked (which writes nothing, so no batch would ever reach
    Monitor.check).

    The clock starts when this worker sees the run's step advance (so model loading and the
    first step after a (re)start never count) and only runs while the run is `running`: a pause
    restarts it (and clears the alert: the trainer reached a step boundary). The median step
    time is that of the run's last 100 `timing/step_s` values, else the pace this watch saw.
    While the trainer says it is evaluating or saving a checkpoint between two steps (`phase`,
    Runner.phase), the clock is held too, for up to ALERT_STALL_PHASE_MAX_S of that phase: a
    long evaluation is no stalled step, a hung one is still seen after the allowance.
    The alert is raised once (an `alert` event + the banner state on the run row) and cleared
    when the next step finishes; if the sink overwrote the banner state meanwhile (its Monitor
    does not own this rule), tick() puts it back without a second event."""

    RULE = "stalled"
    MEDIAN_OF = 100

    def __init__(self, run_id: int, clock: Callable[[], float] = time.monotonic):
        self.run_id = run_id
        self.clock = clock
        self.step: int | None = None     # the run's step as last seen
        self.since: float | None = None  # when it was seen to advance (the clock)
        self.seen: list[tuple[float, int]] = []   # (when, step) advances: the fallback pace
        self.raised = False              # the alert is on (raised here, or by an earlier attempt)
        self._median: tuple[int, float | None] | None = None   # (step, median) cache
        self.phase: tuple[str, float] | None = None   # (the trainer's phase, first seen at)

    def tick(self, now: float | None = None, phase: str | None = None) -> list[Record]:
        """Evaluate the rule once; returns the records written (alert / alert_cleared).
        `phase`: what the trainer reports doing between steps (None: training)."""
        now = self.clock() if now is None else now
        if phase is None:
            self.phase = None
        elif self.phase is None or self.phase[0] != phase:
            self.phase = (phase, now)
        row = Run.objects.filter(pk=self.run_id).values("status", "step", "alerts").first()
        if row is None:
            return []
        on_row = self.RULE in ((row["alerts"] or {}).get("active") or {})
        if self.step is None:            # the first look: nothing finished yet in this attempt
            self.step, self.raised = row["step"], on_row
            return []
        if row["step"] != self.step:     # a step finished (or the run was rewound)
            self.step, self.since = row["step"], now
            self.seen = (self.seen + [(now, row["step"])])[-self.MEDIAN_OF:]
            return self._clear(row["step"], "the next step finished")
        if row["status"] == Status.PAUSED:
            if self.since is not None:
                self.since = now         # paused time is no stall
            return self._clear(row["step"], "the run is paused at a step boundary")
        if row["status"] != Status.RUNNING or self.since is None:
            return []
        if self.phase is not None and now - self.phase[1] <= settings.ALERT_STALL_PHASE_MAX_S:
            self.since = now             # evaluating or checkpointing is no stall (up to a limit)
            return []
        stalled_s = now - self.since
        floor = settings.ALERT_STALL_MIN_S
        if stalled_s <= floor:
            return []
        median = self.median_step_s()
        if median is None:
            return []
        limit = max(floor, settings.ALERT_STALL_FACTOR * median)
        if stalled_s <= limit:
            return []
        note = ""
        if self.phase is not None:   # past the allowance: say what the trainer is stuck in
            note = (f"; {self.phase[0]} for {now - self.phase[1]:.0f} s, more than the "
                    f"{settings.ALERT_STALL_PHASE_MAX_S:g} s allowed")
        if self.raised:
            if not on_row:               # the sink's Monitor wrote the banner state without it
                self._write(None, lambda active: active.setdefault(
                    self.RULE, {"message": self.message(stalled_s, median, limit, note),
                                "step": row["step"]}))
            return []
        message = self.message(stalled_s, median, limit, note)
        rec = alert_record(row["step"], self.RULE, message, stalled_s=round(stalled_s, 1),
                           median_step_s=round(median, 4), limit_s=round(limit, 1),
                           factor=settings.ALERT_STALL_FACTOR, min_s=floor)
        self._write(rec, lambda active: active.__setitem__(self.RULE, {"message": message,
                                                                        "step": row["step"]}))
        self.raised = True
        return [rec]

    @staticmethod
    def message(stalled_s: float, median: float, limit: float, phase: str = "") -> str:
        def secs(x: float) -> str:
            return f"{x:.0f}" if x >= 10 else f"{x:.2g}"
        return (f"stalled: no step finished for {secs(stalled_s)} s (median step time {median:.3g} s; "
                f"the limit is {secs(limit)} s = max({settings.ALERT_STALL_FACTOR:g} x median, "
                f"{settings.ALERT_STALL_MIN_S:g} s))" + phase)

    def median_step_s(self) -> float | None:
        if self._median is not None and self._median[0] == self.step:
            return self._median[1]
        values = [v for v in MetricPoint.objects.filter(run_id=self.run_id, key="timing/step_s",
                                                        value__isnull=False)
                  .order_by("-step").values_list("value", flat=True)[:self.MEDIAN_OF]
                  if math.isfinite(v) and v >= 0]
        median = statistics.median(values) if values else None
        if median is None and len(self.seen) >= 2:   # no step timings: the pace seen here
            (t0, s0), (t1, s1) = self.seen[0], self.seen[-1]
            median = (t1 - t0) / (s1 - s0) if s1 > s0 else None
        self._median = (self.step, median)
        return median

    def _clear(self, step: int, why: str) -> list[Record]:
        if not self.raised:
            return []
        self.raised = False
        rec = Record("event", step, "alert_cleared", {"rule": self.RULE, "reason": why})
        self._write(rec, lambda active: active.pop(self.RULE, None))
        return [rec]

    def _write(self, record: Record | None, change: Callable[[dict], Any]) -> None:
        """Apply `change` to the run's active alerts and append `record`, under the row lock (the
        sink writes the same row)."""
        actions.change_alerts(self.run_id, change, record)
