"""GRESO selective rollouts ("Act Only When It Pays"), top to bottom.

A prompt whose whole group got the same reward teaches GRPO nothing (every advantage is 0), and
such prompts tend to stay that way. GRESO skips them *before* generation, probabilistically:

1. Trace. Each prompt keeps (step, mean reward of its group) for the times it was rolled out,
   with the group's outcome (`record`):
     - "all_correct": all rewards equal and >= 1 (1.0 - 1e-9 counts as 1);
     - "all_wrong":   all rewards equal and < 1 (0, or a small negative overlong penalty, or
                      any other constant below full marks: the group has no signal either way);
     - "mixed":       the rewards differ (by more than 1e-9).
   Only the `max_trace` most recent entries of each prompt are kept.
2. Skip (`decide`). A prompt whose trace ends in z >= 1 consecutive all-correct groups is
   "easy", one ending in z >= 1 consecutive all-wrong groups is "hard". It is kept with
   probability max(p**z, p_floor), p = p_easy or p_hard, and skipped otherwise. A prompt with
   no history, or whose last group was mixed, is always kept. One draw from the filter's own
   seeded RNG per easy/hard prompt, none for the others.
   Forgetting (`forget_half_life` h > 0, in training steps; 0 = never, the paper's rule): a
   record ages, and the keep probability goes back toward 1 (exploration) as it does,

       keep = 1 - (1 - max(p**z, p_floor)) * 2**(-age / h)

   with age = the filter's clock (the latest step it recorded) minus the step of the prompt's
   last group. A record h steps old skips half as often as a fresh one, 2h steps old a quarter
   as often. A half-life rather than a window: the skip probability fades smoothly (a window
   drops a whole record at once, and a long streak and a short one would vanish together),
   one number sets it, and age 0 is the unforgetting rule exactly, so h is safe to change
   mid-run. Whatever h, a prompt is still skipped only by its own zero-variance streak.
3. Adapt (`adapt`, once per step). With alpha the target zero-variance ratio: if the share of
   all-correct groups among the groups rolled out this step is >= alpha/3, p_easy falls by
   delta_p (explore easy prompts less), else it rises; the same for all-wrong groups against
   2*alpha/3 and p_hard. Both are clamped to [min_p, max_p]. A step with no groups changes
   nothing. Only groups whose prompt already had a trace count (`adapt_from_groups`), as in
   the reference implementation: the filter can only have skipped prompts with history, so
   first-time prompts say nothing about whether it skips too much; counting them would drive p
   to min_p on a large dataset before any prompt recurs.

4. Judge. A skip is judged when its prompt is next rolled out: wrong when that group was mixed
   (the skipped rollout would have had signal), right otherwise (`take_skip_judgements`, the
   `greso/wrong_skip_ratio` metric the pilot reads).

5. Warm start (`import_history`). A new run can start from another run's filter state (its
   `state_dict`): p_easy / p_hard, and the traces of the prompts both runs share (by problem
   id), their steps moved so that the source's clock is this filter's: ages, and so
   the first decisions, are the source's at its end. The RNG and the pending skip judgements
   stay this run's own. Whether the two runs' problem ids name the same problems is the
   caller's business (trainer/run/warm_start.py).

DAPO dynamic sampling, which drops zero-variance groups after generation instead, is
`trainer/rollout/dynamic.py`.

This module is pure logic: no model, no config object of its own (`cfg` is the `greso` config
section), no metrics. Whether GRESO is enabled is the caller's business. Unit tests with
hand-computed cases: tests/test_greso.py, tests/test_greso_forget.py (forgetting, the drift task),
tests/test_greso_warm.py (warm start).
"""
from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass

ALL_CORRECT = "all_correct"
ALL_WRONG = "all_wrong"
MIXED = "mixed"

_KINDS = (ALL_CORRECT, ALL_WRONG, MIXED)
_SKIP_KIND = {ALL_CORRECT: "easy", ALL_WRONG: "hard"}
_TOL = 1e-9            # reward equality / "reward >= 1" tolerance
_RATIO_TOL = 1e-12     # float slack when comparing a share with alpha/3 or 2*alpha/3


@dataclass
class Decision:
    skip: bool
    kind: str | None      # "easy", "hard" or None
    streak: int           # z: consecutive all-correct (easy) or all-wrong (hard) groups at the end
    keep_prob: float      # max(p**z, p_floor), aged when forgetting; 1.0 for non-skippable prompts
    age: int = 0          # steps since the prompt's last group (the filter's clock)


def classify(rewards: list[float]) -> str:
    """"all_correct" | "all_wrong" | "mixed" for one group's rewards (see the module docstring)."""
    if not rewards:
        raise ValueError("a group needs at least one reward")
    lo, hi = min(rewards), max(rewards)
    if hi - lo > _TOL:
        return MIXED
    return ALL_CORRECT if lo >= 1.0 - _TOL else ALL_WRONG


def keep_probability(p: float, streak: int, p_floor: float, age: int = 0,
                     half_life: float = 0) -> float:
    """max(p**z, p_floor), capped at 1; with a half-life h > 0, moved back toward 1 by the
    record's age: 1 - (1 - that) * 2**(-age / h)."""
    keep = min(1.0, max(p ** streak, p_floor))
    if half_life > 0 and age > 0:
        keep = 1.0 - (1.0 - keep) * 2.0 ** (-age / half_life)
    return keep


class GresoFilter:
    """Per-prompt reward traces, the skip decision, and the self-adjusting p_easy / p_hard."""

    def __init__(self, *, p_easy: float = 0.5, p_hard: float = 0.5, seed: int = 0,
                 max_trace: int = 32):
        if max_trace < 1:
            raise ValueError(f"max_trace must be >= 1, got {max_trace}")
        self.p_easy = float(p_easy)
        self.p_hard = float(p_hard)
        self.max_trace = int(max_trace)
        self._rng = random.Random(seed)
        # problem_id -> most recent (step, mean reward, outcome kind), oldest first
        self._traces: dict[str, deque[tuple[int, float, str]]] = {}
        self._skipped: dict[str, int] = {}   # problem_id -> skips since its last rollout
        self._judged = [0, 0]                # [wrong, right] skips judged since the last take
        self.clock = 0                       # the latest step recorded: "now" for a record's age

    # -- traces -------------------------------------------------------------------------------

    def record(self, problem_id: str, step: int, rewards: list[float]) -> str:
        """Append (step, mean reward) and the group's outcome; return the outcome kind."""
        kind = classify(rewards)
        mean = math.fsum(rewards) / len(rewards)
        skipped = self._skipped.pop(problem_id, 0)
        self._judged[0 if kind == MIXED else 1] += skipped
        trace = self._traces.get(problem_id)
        if trace is None:
            trace = self._traces[problem_id] = deque(maxlen=self.max_trace)
        trace.append((int(step), float(mean), kind))
        self.clock = max(self.clock, int(step))
        return kind

    def trace(self, problem_id: str) -> list[tuple[int, float]]:
        """(step, mean reward) of the prompt's recorded groups, oldest first ([] if none)."""
        return [(step, mean) for step, mean, _ in self._traces.get(problem_id, ())]

    def streak(self, problem_id: str) -> tuple[str | None, int]:
        """("easy" | "hard", z) for a trace ending in z >= 1 zero-variance groups of one kind;
        (None, 0) for no history or a last group that was mixed."""
        trace = self._traces.get(problem_id)
        if not trace:
            return None, 0
        last = trace[-1][2]
        if last == MIXED:
            return None, 0
        z = 0
        for _, _, kind in reversed(trace):
            if kind != last:
                break
            z += 1
        return _SKIP_KIND[last], z

    # -- the decision -------------------------------------------------------------------------

    def decide(self, problem_id: str, cfg) -> Decision:
        """Skip or keep this prompt before generation (cfg: the `greso` config section)."""
        kind, z = self.streak(problem_id)
        if kind is None:
            return Decision(skip=False, kind=None, streak=0, keep_prob=1.0)
        p = self.p_easy if kind == "easy" else self.p_hard
        age = self.age(problem_id)
        keep_prob = keep_probability(p, z, cfg.p_floor, age, cfg.forget_half_life)
        skip = self._rng.random() >= keep_prob     # P(skip) = 1 - keep_prob
        if skip:
            self._skipped[problem_id] = self._skipped.get(problem_id, 0) + 1
        return Decision(skip=skip, kind=kind, streak=z, keep_prob=keep_prob, age=age)

    def age(self, problem_id: str) -> int:
        """Steps from the prompt's last recorded group to the filter's clock (0 without one)."""
        trace = self._traces.get(problem_id)
        return self.clock - trace[-1][0] if trace else 0

    def take_skip_judgements(self) -> tuple[int, int]:
        """(wrong, right): skips judged since the last call -- a skipped prompt's next group was
        mixed (wrong: it had signal) or not (right) -- and start counting again."""
        wrong, right = self._judged
        self._judged = [0, 0]
        return wrong, right

    # -- exploration probabilities --------------------------------------------------------------

    def adapt(self, n_groups: int, n_all_correct: int, n_all_wrong: int, cfg) -> None:
        """Move p_easy / p_hard one delta_p step toward the target zero-variance ratio."""
        if n_all_correct < 0 or n_all_wrong < 0 or n_all_correct + n_all_wrong > max(n_groups, 0):
            raise ValueError(f"bad group counts: {n_groups} groups, {n_all_correct} all-correct, "
                             f"{n_all_wrong} all-wrong")
        if n_groups <= 0:
            return
        easy_share = n_all_correct / n_groups
        hard_share = n_all_wrong / n_groups
        self.p_easy = self._step(self.p_easy, easy_share >= cfg.alpha / 3 - _RATIO_TOL, cfg)
        self.p_hard = self._step(self.p_hard, hard_share >= 2 * cfg.alpha / 3 - _RATIO_TOL, cfg)

    def adapt_from_groups(self, groups: list[tuple[str, list[float]]], cfg) -> int:
        """`adapt` from this step's (problem id, rewards) groups whose prompt had a trace before
        this step; call it before `record`ing them. Returns how many groups counted."""
        kinds = [classify(rewards) for pid, rewards in groups if self._traces.get(pid)]
        self.adapt(len(kinds), kinds.count(ALL_CORRECT), kinds.count(ALL_WRONG), cfg)
        return len(kinds)

    @staticmethod
    def _step(p: float, too_many: bool, cfg) -> float:
        p = p - cfg.delta_p if too_many else p + cfg.delta_p
        return min(cfg.max_p, max(cfg.min_p, p))

    # -- checkpointing ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Plain lists/dicts/numbers/strings: JSON- and torch.save(weights_only)-safe."""
        version, internal, gauss_next = self._rng.getstate()
        return {
            "p_easy": self.p_easy,
            "p_hard": self.p_hard,
            "max_trace": self.max_trace,
            "traces": {pid: [[step, mean, kind] for step, mean, kind in trace]
                       for pid, trace in self._traces.items()},
            "rng": [version, list(internal), gauss_next],
            "skipped": dict(self._skipped),
            "clock": self.clock,
        }

    def import_history(self, state: dict, problem_ids) -> int:
        """Start warm from another run's filter state (its `state_dict`): its p_easy / p_hard,
        and the traces of the prompts in `problem_ids` that it has, with their steps moved so
        that its clock is this filter's. Returns how many prompts came warm."""
        self.p_easy = float(state["p_easy"])
        self.p_hard = float(state["p_hard"])
        source = _parse_traces(state["traces"], self.max_trace)
        shift = self.clock - int(state.get("clock", _clock_of(source)))
        n = 0
        for pid in problem_ids:
            trace = source.get(pid)
            if trace:
                self._traces[pid] = deque(((step + shift, mean, kind) for step, mean, kind in trace),
                                          maxlen=self.max_trace)
                n += 1
        return n

    def load_state_dict(self, state: dict) -> None:
        self.p_easy = float(state["p_easy"])
        self.p_hard = float(state["p_hard"])
        self.max_trace = int(state.get("max_trace", self.max_trace))
        self._traces = _parse_traces(state["traces"], self.max_trace)
        # a checkpoint from before forgetting has no clock: its latest recorded step is one
        self.clock = int(state.get("clock", _clock_of(self._traces)))
        self._skipped = {str(k): int(v) for k, v in (state.get("skipped") or {}).items()}
        version, internal, gauss_next = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss_next))



def _parse_traces(entries_by_pid: dict, max_trace: int) -> dict[str, deque[tuple[int, float, str]]]:
    """A state_dict's traces as the filter holds them (the `max_trace` latest of each)."""
    traces: dict[str, deque[tuple[int, float, str]]] = {}
    for pid, entries in entries_by_pid.items():
        trace: deque[tuple[int, float, str]] = deque(maxlen=max_trace)
        for step, mean, kind in entries:
            if kind not in _KINDS:
                raise ValueError(f"unknown outcome kind {kind!r} in the trace of {pid!r}")
            trace.append((int(step), float(mean), kind))
        traces[str(pid)] = trace
    return traces


def _clock_of(traces: dict) -> int:
    """The latest step recorded in `traces` (each trace keeps its latest entry); 0 for none."""
    return max((trace[-1][0] for trace in traces.values() if trace), default=0)
