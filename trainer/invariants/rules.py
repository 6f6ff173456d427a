"""The invariants a training step must hold, checked from what it actually trains.

A step hands in its trained samples (`TrainedSample`: the group's draw, the member's index, each
response token's policy version and loss weight) and the bound in force at that step (`Bounds`,
knob changes and schedules applied). `check` returns one `Violation` per rule broken:

    beyond_eta     asynchronous: a trained model token is more than eta versions older than the
                   policy the step trains, age = version - v > eta (async.max_staleness)
    beyond_span    synchronous: a trained model token older than april.max_version_span
                   (span_policy "drop"; without APRIL 0: a synchronous step trains only tokens
                   its own policy sampled)
    trained_twice  a sample (draw/index: its group's data-cursor position and its place in the
                   group; an episode is a sample) trained again, in this step or an earlier one
    env_loss       an environment token (version ENV_VERSION: a tool's result, feedback; the
                   model never wrote it) carrying loss (weight > 0)

A token is trained when its loss weight is > 0 (a masked or rejected token is not); a sample is
trained when any of its tokens is. `TrainedIds` remembers the samples trained so far, bounded by
the number of groups it keeps (the oldest forgotten first), with a state for checkpoints so a
resumed run keeps it. Hand-built batches: tests/test_invariants.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from trainer.engine.base import ENV_VERSION

RULES = ("beyond_eta", "beyond_span", "trained_twice", "env_loss")
KEEP_GROUPS = 8192   # groups TrainedIds remembers: far more than a buffer or a queue holds


@dataclass(frozen=True)
class TrainedSample:
    draw: int                      # its group's data-cursor position (the group's id)
    index: int                     # its place in the group
    versions: tuple[int, ...]      # per response token: the policy version, ENV_VERSION
    weights: tuple[float, ...]     # per response token: its loss weight (0 = not trained)

    @property
    def id(self) -> str:
        return f"{self.draw}/{self.index}"

    def trained(self) -> bool:
        return any(w > 0 for w in self.weights)


@dataclass(frozen=True)
class Bounds:
    version: int            # the policy version the step trains
    rule: str               # "beyond_eta" or "beyond_span": the age bound's rule
    max_age: int | None     # the largest token age allowed; None = no bound


@dataclass
class Violation:
    rule: str
    step: int
    samples: list[str] = field(default_factory=list)   # "draw/index" of each offending sample
    detail: str = ""

    @property
    def count(self) -> int:
        return len(self.samples)

    def as_json(self, max_ids: int = 50) -> dict:
        return {"rule": self.rule, "step": self.step, "count": self.count,
                "samples": self.samples[:max_ids], "detail": self.detail}


class TrainedIds:
    """The samples trained so far, by group (insertion order: the oldest group forgotten first
    past `keep_groups`)."""

    def __init__(self, keep_groups: int = KEEP_GROUPS):
        if keep_groups < 1:
            raise ValueError(f"keep_groups must be >= 1; got {keep_groups}")
        self.keep_groups = keep_groups
        self._groups: dict[int, set[int]] = {}

    def __contains__(self, key: tuple[int, int]) -> bool:
        draw, index = key
        return index in self._groups.get(draw, ())

    def add(self, draw: int, index: int) -> None:
        self._groups.setdefault(draw, set()).add(index)
        while len(self._groups) > self.keep_groups:
            del self._groups[next(iter(self._groups))]

    def state_dict(self) -> dict:
        return {"groups": [[d, sorted(ix)] for d, ix in self._groups.items()]}

    def load_state_dict(self, state: dict) -> None:
        self._groups = {int(d): set(map(int, ix)) for d, ix in state.get("groups", [])}


def token_age_violations(step: int, samples: list[TrainedSample], bounds: Bounds) -> Violation | None:
    """The trained samples with a trained model token older than `bounds.max_age`."""
    if bounds.max_age is None:
        return None
    bad, oldest = [], 0
    for s in samples:
        ages = [bounds.version - v for v, w in zip(s.versions, s.weights)
                if w > 0 and v != ENV_VERSION]
        age = max(ages, default=0)
        if age > bounds.max_age:
            bad.append(s.id)
            oldest = max(oldest, age)
    if not bad:
        return None
    return Violation(bounds.rule, step, bad, f"trained tokens {oldest} versions old at policy "
                     f"{bounds.version}; the bound in force is {bounds.max_age}")


def repeat_violations(step: int, samples: list[TrainedSample], seen: TrainedIds) -> Violation | None:
    """The trained samples trained before (in `seen`, or earlier in `samples`); adds them all."""
    bad = []
    for s in samples:
        if not s.trained():
            continue
        if (s.draw, s.index) in seen:
            bad.append(s.id)
        seen.add(s.draw, s.index)
    if not bad:
        return None
    groups = sorted({int(i.split("/")[0]) for i in bad})
    return Violation("trained_twice", step, bad, f"{len(bad)} sample(s) of {len(groups)} group(s) "
                     f"trained again (groups {', '.join(map(str, groups[:10]))})")


def env_loss_violations(step: int, samples: list[TrainedSample]) -> Violation | None:
    """The samples with an environment token carrying loss."""
    bad = [s.id for s in samples
           if any(v == ENV_VERSION and w > 0 for v, w in zip(s.versions, s.weights))]
    if not bad:
        return None
    return Violation("env_loss", step, bad, "environment tokens (tool results, feedback) carry loss")


def check(step: int, samples: list[TrainedSample], bounds: Bounds, seen: TrainedIds) -> list[Violation]:
    """Every rule's violation at `step` (none: the step held them all); `seen` takes the step's
    trained samples."""
    for s in samples:
        if len(s.versions) != len(s.weights):
            raise ValueError(f"sample {s.id}: {len(s.versions)} versions for {len(s.weights)} weights")
    found = [token_age_violations(step, samples, bounds), repeat_violations(step, samples, seen),
             env_loss_violations(step, samples)]
    return [v for v in found if v is not None]


def figures(violations: list[Violation], bounds: Bounds | None = None) -> dict[str, float]:
    """invariants/<rule>: the samples that broke it this step (0 when it held), and
    invariants/bound, the age bound in force (absent when there is none)."""
    m = {f"invariants/{rule}": 0.0 for rule in RULES}
    for v in violations:
        m[f"invariants/{v.rule}"] += v.count
    if bounds is not None and bounds.max_age is not None:
        m["invariants/bound"] = float(bounds.max_age)
    return m
