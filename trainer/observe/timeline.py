"""Where the time goes, per process: spans of (lane, phase, start, end[, occupancy]).

A lane is one process or worker: "rank 0" (the controller), "rank r" (a training rank), a
generator ("engine" for the embedded engine, in the controller or its own process). A phase is
what that lane was doing (PHASES); the time between two spans of a lane is unrecorded (for a
training rank: waiting). Times are seconds on `clock.now()`: the wall clock at the run's anchor
advanced by the monotonic clock, so a span's length never holds a step of the wall clock (NTP)
and lanes of several processes on one machine line up. `occupancy` (0..1) is a generator's batch occupancy: decoded
sequences over engine slots, averaged over the span weighted by slots.

- `Timeline` is the controller's recorder: `with timeline.span("rank 0", "training"): ...`,
  `add()` for spans measured elsewhere, and `take()` for the spans since the last call, merged
  and bounded (`bound`), which the runner hands to `MetricsSink.timeline(step, spans)` once a
  step.
- `BusyRecorder` is a generator's: `record(start, end, used, capacity)` after each engine step
  coalesces steps closer than `gap_s` into one busy span, so a step of hundreds of decode steps
  costs a few spans; `take()` returns them as `(lane, start, end, occupancy)` tuples, the
  format of an engine's optional `take_busy_spans()`.
- `phase_seconds` and `covered_seconds` read a run's steps back (the dashboard's report, a
  benchmark's idle shares per lane).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

from trainer.observe import clock as run_clock

# what a lane may be doing; the dashboard colours each one (static/dashboard/timeline.js)
PHASES = ("generating", "waiting", "training", "syncing weights", "recording samples",
          "evaluating", "checkpointing", "paused", "bookkeeping", "tool")
TOOLS_LANE = "tools"   # an episode's tool calls (trainer/episode/engine.py), beside decoding
CONTROLLER = "rank 0"
MAX_SPANS = 48       # per step, every lane together
MERGE_GAP_S = 0.01   # same-phase spans of a lane closer than this are one span
MIN_SPAN_S = 0.001   # shorter spans are dropped (a boundary crossed at once is no "paused")
# ... but not a tool call: however short (a calculator's is ~0.1 ms), it happened, and the
# "tools" lane shows when episodes called tools (the dashboard draws it at least a few pixels wide)
KEEP_SHORT = ("tool",)


def rank_lane(rank: int) -> str:
    return f"rank {rank}"


@dataclass
class Span:
    lane: str
    phase: str
    start: float
    end: float
    occupancy: float | None = None

    def __post_init__(self):
        if not self.lane:
            raise ValueError("a span needs a lane")
        if self.phase not in PHASES:
            raise ValueError(f"unknown phase {self.phase!r}; expected one of {', '.join(PHASES)}")
        if not self.end >= self.start:
            raise ValueError(f"a span ends ({self.end}) before it starts ({self.start})")
        if self.occupancy is not None and not 0.0 <= self.occupancy <= 1.0:
            raise ValueError(f"occupancy {self.occupancy} is outside [0, 1]")

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def as_dict(self) -> dict:
        d = {"lane": self.lane, "phase": self.phase, "start": round(self.start, 4),
             "end": round(self.end, 4)}
        if self.occupancy is not None:
            d["occupancy"] = round(self.occupancy, 3)
        return d


def _joined(a: Span, b: Span) -> Span:
    """One span covering a and b (same lane and phase); occupancy weighted by duration."""
    occ = a.occupancy if b.occupancy is None else b.occupancy if a.occupancy is None else (
        (a.occupancy * a.seconds + b.occupancy * b.seconds) / max(a.seconds + b.seconds, 1e-12))
    return Span(a.lane, a.phase, a.start, max(a.end, b.end), occ)


def bound(spans: list[Span], max_spans: int = MAX_SPANS, merge_gap_s: float = MERGE_GAP_S,
          min_span_s: float = MIN_SPAN_S) -> list[Span]:
    """Spans sorted by lane and start, at most `max_spans` of them, none overlapping in a lane:
    1. spans shorter than `min_span_s` go (but a tool call: KEEP_SHORT); a span starting
       before its lane's previous one ends starts where it ends (a lane does one thing at a time);
    2. same-phase neighbours closer than `merge_gap_s` become one span;
    3. while there are too many, in the lane with the most spans the same-phase neighbours
       with the smallest gap merge (a generator's busy spans around a short idle moment; on a
       tie the pair that makes the shortest span, so merging spreads instead of snowballing),
       or, with none left, its shortest span goes (its time shows as a gap)."""
    lanes: dict[str, list[Span]] = {}
    for s in sorted(spans, key=lambda s: (s.start, s.end)):
        if s.seconds < min_span_s and s.phase not in KEEP_SHORT:
            continue
        lane = lanes.setdefault(s.lane, [])
        if lane and s.start < lane[-1].end:
            if s.end <= lane[-1].end:
                continue
            s = Span(s.lane, s.phase, lane[-1].end, s.end, s.occupancy)
        if lane and lane[-1].phase == s.phase and s.start - lane[-1].end <= merge_gap_s:
            lane[-1] = _joined(lane[-1], s)
        else:
            lane.append(s)
    total = sum(len(v) for v in lanes.values())
    while total > max(max_spans, 1):
        lane = max(lanes.values(), key=len)
        gaps = [(lane[i + 1].start - lane[i].end, lane[i + 1].end - lane[i].start, i)
                for i in range(len(lane) - 1) if lane[i].phase == lane[i + 1].phase]
        if gaps:
            *_, i = min(gaps)   # the smallest gap; on a tie the shortest result
            lane[i:i + 2] = [_joined(lane[i], lane[i + 1])]
        else:
            lane.remove(min(lane, key=lambda s: s.seconds))
        total -= 1
    return [s for name in lanes for s in lanes[name]]


class Timeline:
    """The controller's spans since the last `take()` (thread-safe: a generation thread may add)."""

    def __init__(self, max_spans: int = MAX_SPANS, clock=run_clock.now, fill: dict[str, str] | None = None):
        """`fill`: {lane: phase} for lanes that are never idle (the controller): the time
        between two of their spans is recorded as that phase (its metrics, controls, the
        step's setup), so a gap in such a lane never reads as waiting."""
        self.max_spans = max_spans
        self.clock = clock
        self.fill = dict(fill or {})
        self._spans: list[Span] = []
        self._last_end: dict[str, float] = {}   # the filled lanes' and add_after_wait's
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def span(self, lane: str, phase: str, occupancy=None):
        """Record the body's time as `phase` on `lane` (also when it raises).
        `occupancy` may be a callable, asked when the body has run."""
        start = self.clock()
        try:
            yield
        finally:
            occ = occupancy() if callable(occupancy) else occupancy
            self.add(lane, phase, start, self.clock(), occ)

    def add(self, lane: str, phase: str, start: float, end: float,
            occupancy: float | None = None) -> None:
        span = Span(lane, phase, float(start), float(end),
                    None if occupancy is None else min(1.0, max(0.0, float(occupancy))))
        with self._lock:
            last = self._last_end.get(lane) if lane in self.fill else None
            if last is not None and span.start > last:
                self._spans.append(Span(lane, self.fill[lane], last, span.start))
            if lane in self.fill:
                self._last_end[lane] = max(span.end, last or span.end)
            self._spans.append(span)
            if len(self._spans) > 8 * self.max_spans:   # nobody takes them: stay bounded
                self._spans = bound(self._spans, 4 * self.max_spans)

    def add_after_wait(self, lane: str, phase: str, start: float, end: float) -> None:
        """A span of a lane that only waits between its spans (a training rank): the time since
        the lane's previous span is recorded as `waiting`."""
        last = self._last_end.get(lane)
        if last is not None and start > last:
            self.add(lane, "waiting", last, start)
        self.add(lane, phase, start, end)
        self._last_end[lane] = end

    def pending(self) -> list[dict]:
        """The spans not yet taken, as dicts, left where they are."""
        with self._lock:
            return [s.as_dict() for s in self._spans]

    def take(self) -> list[dict]:
        """The spans since the last call, bounded (`bound`), as JSON-ready dicts."""
        with self._lock:
            spans, self._spans = self._spans, []
        return [s.as_dict() for s in bound(spans, self.max_spans)]


class BusyRecorder:
    """A generator's busy intervals (engine steps), coalesced as they come; bounded."""

    def __init__(self, lane: str = "engine", gap_s: float = 0.05, max_spans: int = 256):
        self.lane, self.gap_s, self.max_spans = lane, gap_s, max_spans
        self._spans: list[list[float]] = []   # [start, end, slots used, slot capacity]
        self._lock = threading.Lock()

    def record(self, start: float, end: float, used: int = 0, capacity: int = 0) -> None:
        with self._lock:
            last = self._spans[-1] if self._spans else None
            if last is not None and start - last[1] <= self.gap_s:
                last[1] = max(last[1], end)
                last[2] += used
                last[3] += capacity
            else:
                self._spans.append([start, end, used, capacity])
                if len(self._spans) > self.max_spans:   # the pair with the smallest gap merges
                    i = min(range(len(self._spans) - 1),
                            key=lambda k: self._spans[k + 1][0] - self._spans[k][1])
                    a, b = self._spans[i], self._spans.pop(i + 1)
                    a[1], a[2], a[3] = b[1], a[2] + b[2], a[3] + b[3]

    def take(self) -> list[tuple[str, float, float, float | None]]:
        with self._lock:
            spans, self._spans = self._spans, []
        return [(self.lane, s, e, used / cap if cap else None) for s, e, used, cap in spans]


# --- reading a run's timeline (timeline.jsonl, the dashboard's rows): lists of span dicts --------

def phase_seconds(slices) -> dict[str, dict[str, float]]:
    """{lane: {phase: seconds}} over every slice (a step's list of span dicts)."""
    out: dict[str, dict[str, float]] = {}
    for spans in slices:
        for s in spans:
            lane = out.setdefault(s["lane"], {})
            lane[s["phase"]] = lane.get(s["phase"], 0.0) + s["end"] - s["start"]
    return {lane: {p: round(v, 3) for p, v in phases.items()} for lane, phases in out.items()}


def covered_seconds(slices) -> float:
    """Wall-clock seconds the slices cover: the union of each slice's first start to last end
    (a generator's span may reach into the next step's time; a resumed run leaves a hole). A
    lane's time outside its spans in there is idle (or unrecorded)."""
    cover = sorted((min(s["start"] for s in spans), max(s["end"] for s in spans))
                   for spans in slices if spans)
    total, reach = 0.0, float("-inf")
    for start, end in cover:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
