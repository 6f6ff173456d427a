"""The autopilot: the pilot's advice applied by the trainer itself, within bounds, and undone when
it hurt (docs/pilot.md).

Opt-in per run: `pilot.autopilot` names the rules it may act for (a knob: turned on or off
mid-run; off leaves the values as they are). After each step `decide` returns at most one move:

1. A change it made is watched for `pilot.every` steps. Then its guards compare those steps with
   the `pilot.every` steps before it: any change is undone when the mean accuracy (else mean
   reward) fell by more than `pilot.guard_accuracy_drop`; a change made for throughput (more
   over-sampling, a larger eta, more GRESO skipping) also when the median trained tokens/s fell
   by more than `pilot.guard_throughput_drop`. An undone move is not made again from the same
   value with the same reason in this run.
2. Otherwise, at least `pilot.every` steps after its last change (and after a person's last
   change), the first piece of advice of an enabled rule that names a knob becomes the move, its
   value kept inside `pilot.bounds` (and the knob's own range); advice it cannot follow inside the
   bounds is passed over. A move that takes a knob back where its previous move took it from
   cancels that previous move for good, so two rules cannot see-saw a knob.
3. A person's change wins: a knob a person (dashboard, CLI) changed during the run is theirs from
   then on -- the autopilot does not move it again; and a change of the autopilot's being watched
   when a person changes any knob is kept unjudged (the guards could no longer tell whose change
   moved the figures). A point of async.staleness_schedule sets eta at its step (a watched change
   of eta then ends unjudged); the autopilot may move eta again `pilot.every` steps later.

Each move is a knob change like a person's (the step boundary validates, applies between two steps
and records it as a `knob_applied` event, requested by "autopilot", with the advice and its
evidence as the reason). Pure logic over metric rows and the config: tests drive it directly.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from trainer import config as config_mod
from trainer.pilot import rules
from trainer.pilot.advice import Advice
from trainer.pilot.thresholds import DEFAULT, Thresholds
from trainer.pilot.window import Window, standard_error_of_difference

THROUGHPUT = "perf/trained_tokens_per_s"
ACCURACY = ("reward/accuracy", "reward/mean")   # the first a run reports
# (rule, reason) of the advice that trades nothing for speed: their changes answer for throughput
FOR_THROUGHPUT = {("staleness", "eta_starves_generation"), ("april", "idle_decode_slots"),
                  ("greso", "zero_variance_above_target")}


@dataclass
class Move:
    """A knob change the autopilot asks for at the next step boundary."""
    knobs: dict[str, Any]
    reason: dict[str, Any]   # kept in the knob_applied event: the rule, the advice, the evidence


@dataclass
class Watched:
    """A change of the autopilot's whose effect is still being watched."""
    step: int                # the last step before it (it applies from step + 1)
    knob: str
    old: Any
    new: Any
    rule: str
    reason: str
    evidence_key: str
    for_throughput: bool
    confirmed: bool = False  # the boundary applied it (a refused change is not watched)


@dataclass
class Autopilot:
    thresholds: Thresholds = DEFAULT
    last_move_step: int | None = None
    watched: Watched | None = None
    undone: list[str] = field(default_factory=list)     # evidence keys of moves it undid
    persons_knobs: list[str] = field(default_factory=list)   # knobs a person changed: theirs
    persons_step: int | None = None      # the step after which a person last changed a knob
    scheduled_step: int | None = None    # ... and after which async.staleness_schedule did
    last_seen_step: int = 0
    # knob -> (old, new, evidence key) of its latest move: a move back cancels that move for good
    last_moves: dict[str, list] = field(default_factory=dict)

    # --- what happened at the boundary --------------------------------------------------------
    def knob_applied(self, knobs: Sequence[str], by_autopilot: bool) -> None:
        """A knob change the boundary applied: a person's makes those knobs theirs."""
        if by_autopilot:
            if self.watched is not None and self.watched.knob in knobs:
                self.watched.confirmed = True
            return
        for k in knobs:
            if k not in self.persons_knobs:
                self.persons_knobs.append(k)
        self.persons_step = self.last_seen_step   # their change settles before our next move
        # the person's value stands; and after any change of theirs, what the guards would read
        # is no longer our change's effect alone (seen: a person's lr change collapsed accuracy,
        # and the guard undid the autopilot's eta change for it): keep our change, unjudged
        self.watched = None

    def knob_scheduled(self, knobs: Sequence[str]) -> None:
        """async.staleness_schedule set a knob at its point: the knob stays the autopilot's to
        move, after pilot.every steps to settle (as after a person's change); a change of ours
        to it being watched is replaced, so it is not judged."""
        self.scheduled_step = self.last_seen_step
        if self.watched is not None and self.watched.knob in knobs:
            self.watched = None

    def knob_refused(self, knobs: Sequence[str]) -> None:
        """The boundary refused the autopilot's change (the config's cross-field rules)."""
        if self.watched is not None and self.watched.knob in knobs:
            self.watched = None

    # --- after each step ----------------------------------------------------------------------
    def decide(self, step: int, rows: Sequence[dict], cfg: config_mod.Config,
               advice: Sequence[Advice]) -> Move | None:
        """The move to ask for after `step` (`rows`: the run's recent metric rows, oldest first,
        `advice`: the pilot's advice on them), or None."""
        pc = cfg.pilot
        self.last_seen_step = step
        if not pc.autopilot:
            self.watched = None   # turned off: the values stay as they are
            return None
        if self.watched is not None:
            if step - self.watched.step < pc.every:
                return None
            undo = self._judge(step, rows, cfg)
            if undo is not None:
                return undo
        if any(s is not None and step - s < pc.every
               for s in (self.last_move_step, self.persons_step, self.scheduled_step)):
            return None
        bounds = config_mod.pilot_bounds(pc.bounds)
        for a in advice:
            if a.knob is None or a.rule not in pc.autopilot or a.knob in self.persons_knobs \
                    or a.evidence_key in self.undone:
                continue
            value = inside(a.proposed, bounds.get(a.knob))
            if value == a.current:
                continue   # the bounds leave no room for this move
            previous = self.last_moves.get(a.knob)
            if previous and previous[:2] == [value, a.current]:
                self.undone.append(previous[2])   # a move back: no going forth again (no see-saw)
            self.last_moves[a.knob] = [a.current, value, a.evidence_key]
            self.last_move_step = step
            self.watched = Watched(step, a.knob, a.current, value, a.rule, a.reason, a.evidence_key,
                                   (a.rule, a.reason) in FOR_THROUGHPUT)
            return Move({a.knob: value}, {
                "rule": a.rule, "reason": a.reason, "evidence_key": a.evidence_key,
                "message": a.message, "expected": a.expected, "confidence": a.confidence,
                "advised": a.proposed, "bounds": list(bounds[a.knob]) if a.knob in bounds else None,
                "evidence": [asdict(f) for f in a.evidence]})
        return None

    def _judge(self, step: int, rows: Sequence[dict], cfg: config_mod.Config) -> Move | None:
        """The watched change's guards over the steps after it: undo it, or keep it."""
        w, pc = self.watched, cfg.pilot
        self.watched = None
        if not w.confirmed:
            return None
        window = Window(rows)
        before = [r for r in window.rows if w.step - pc.every < r["step"] <= w.step]
        after = [r for r in window.rows if w.step < r["step"] <= w.step + pc.every]
        tripped = guard_trips(before, after, for_throughput=w.for_throughput,
                              throughput_drop=pc.guard_throughput_drop,
                              accuracy_drop=pc.guard_accuracy_drop)
        if tripped is None:
            return None
        self.undone.append(w.evidence_key)
        self.last_moves[w.knob] = [w.new, w.old, None]
        self.last_move_step = step
        return Move({w.knob: w.old}, {"rule": w.rule, "reason": w.reason, "undo_of": w.evidence_key,
                                      "changed_at_step": w.step + 1, **tripped})

    # --- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"last_move_step": self.last_move_step, "undone": list(self.undone),
                "persons_knobs": list(self.persons_knobs), "persons_step": self.persons_step,
                "scheduled_step": self.scheduled_step,
                "last_seen_step": self.last_seen_step, "last_moves": dict(self.last_moves),
                "watched": asdict(self.watched) if self.watched else None}

    def load_state_dict(self, d: dict) -> None:
        self.last_move_step = d.get("last_move_step")
        self.undone = list(d.get("undone") or [])
        self.persons_knobs = list(d.get("persons_knobs") or [])
        self.persons_step = d.get("persons_step")
        self.scheduled_step = d.get("scheduled_step")
        self.last_seen_step = int(d.get("last_seen_step") or 0)
        self.last_moves = {k: list(v) for k, v in (d.get("last_moves") or {}).items()}
        self.watched = Watched(**d["watched"]) if d.get("watched") else None


def inside(value: Any, bounds: tuple[float, float] | None) -> Any:
    """`value` moved inside `bounds` (lo, hi), keeping its type; unchanged without bounds or when
    it is not a number."""
    if bounds is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    lo, hi = bounds
    return type(value)(min(max(value, lo), hi))


def guard_trips(before: Sequence[dict], after: Sequence[dict], *, for_throughput: bool,
                throughput_drop: float, accuracy_drop: float) -> dict | None:
    """The guard that trips over `after` against `before` (metric rows), with its figures, or
    None. Throughput by medians (one slow step -- a checkpoint, an evaluation -- moves neither),
    accuracy by means (a batch's accuracy is a noisy mean already)."""
    if for_throughput:
        b, a = _values(before, THROUGHPUT), _values(after, THROUGHPUT)
        if b and a:
            mb, ma = statistics.median(b), statistics.median(a)
            if mb > 0 and ma < (1.0 - throughput_drop) * mb:
                return {"guard": "throughput", "metric": THROUGHPUT, "before": mb, "after": ma}
    for name in ACCURACY:
        b, a = _values(before, name), _values(after, name)
        if b and a:
            mb, ma = statistics.fmean(b), statistics.fmean(a)
            # a fall within two standard errors is the batches' noise, not the change's doing
            # (3-step windows on batches whose accuracy moves +-0.1 a step undid a raise for nothing)
            noise = 2.0 * standard_error_of_difference(b, a)
            if mb - ma > max(accuracy_drop, noise):
                return {"guard": "accuracy", "metric": name, "before": mb, "after": ma,
                        "noise": noise}
            break
    return None


def _values(rows: Sequence[dict], name: str) -> list[float]:
    return [v for _, v in Window(rows).series(name)]


def advice_for(rows: Sequence[dict], cfg: config_mod.Config,
               thresholds: Thresholds = DEFAULT) -> list[Advice]:
    """The pilot's advice on the latest window of `rows` (nothing before it has min_steps)."""
    return rules.advise(rows, cfg, thresholds=thresholds) if rows else []
