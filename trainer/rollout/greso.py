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

DAPO dynamic sampling, which drops zero-variance groups after generation instead, is
`trainer/rollout/dynamic.py`.

This module is pure logic: no model, no config object of its own (`cfg` is the `greso` config
section), no metrics. Whether GRESO is enabled is the caller's business. Unit tests with
hand-computed cases: tests/test_greso.py.
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
    keep_prob: float      # max(p**z, p_floor); 1.0 for non-skippable prompts


def classify(rewards: list[float]) -> str:
    """"all_correct" | "all_wrong" | "mixed" for one group's rewards (see the module docstring)."""
    if not rewards:
        raise ValueError("a group needs at least one reward")
    lo, hi = min(rewards), max(rewards)
    if hi - lo > _TOL:
        return MIXED
    return ALL_CORRECT if lo >= 1.0 - _TOL else ALL_WRONG


def keep_probability(p: float, streak: int, p_floor: float) -> float:
    """max(p**z, p_floor), capped at 1."""
    return min(1.0, max(p ** streak, p_floor))


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
        keep_prob = keep_probability(p, z, cfg.p_floor)
        skip = self._rng.random() >= keep_prob     # P(skip) = 1 - keep_prob
        if skip:
            self._skipped[problem_id] = self._skipped.get(problem_id, 0) + 1
        return Decision(skip=skip, kind=kind, streak=z, keep_prob=keep_prob)

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
        }

    def load_state_dict(self, state: dict) -> None:
        self.p_easy = float(state["p_easy"])
        self.p_hard = float(state["p_hard"])
        self.max_trace = int(state.get("max_trace", self.max_trace))
        traces: dict[str, deque[tuple[int, float, str]]] = {}
        for pid, entries in state["traces"].items():
            trace: deque[tuple[int, float, str]] = deque(maxlen=self.max_trace)
            for step, mean, kind in entries:
                if kind not in _KINDS:
                    raise ValueError(f"unknown outcome kind {kind!r} in the trace of {pid!r}")
                trace.append((int(step), float(mean), kind))
            traces[pid] = trace
        self._traces = traces
        self._skipped = {str(k): int(v) for k, v in (state.get("skipped") or {}).items()}
        version, internal, gauss_next = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss_next))

