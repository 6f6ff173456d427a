"""One piece of advice: the knob, the proposed value, the evidence, the expected effect."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from trainer import config as config_mod
from trainer.accounting import cost
from trainer.pilot.window import Window


@dataclass(frozen=True)
class Figure:
    """One figure a rule read: `stat` ("mean", "last", "share of steps at eta", ...) of metric `name`
    over steps first..last."""
    name: str
    stat: str
    value: float
    first_step: int
    last_step: int


@dataclass(frozen=True)
class Advice:
    rule: str                 # one of RULE_FAMILIES
    reason: str               # which condition fired, e.g. "eta_starves_generation"
    knob: str | None          # dotted tunable key; None: the right move is not a knob
    current: Any              # the knob's value now (None when knob is None)
    proposed: Any             # inside the knob's declared range; None when knob is None
    message: str              # one sentence a person reads
    expected: str             # what should happen after the change
    confidence: str           # "low" | "medium" | "high"
    evidence: tuple[Figure, ...] = field(default_factory=tuple)

    @property
    def evidence_key(self) -> str:
        """Stable while the same conditions advise the same move from the same value: a
        dismissed advice comes back only when this changes (not at every new step)."""
        ident = [self.rule, self.reason, self.knob, self.current, self.proposed]
        return hashlib.sha1(json.dumps(ident, default=str).encode()).hexdigest()[:EVIDENCE_KEY_LEN]

    def as_json(self) -> dict:
        d = asdict(self)
        d["evidence"] = [asdict(f) for f in self.evidence]
        d["evidence_key"] = self.evidence_key
        return d


# the ledger's drop reasons (trainer/rollout/ledger.py) each rule's advice is about: what the
# condition it advises on costs is what those drops cost (docs/cost.md, "Priced waste")
WASTE_ADDRESSED = {"april": ("version_span", "surplus", "aborted"), "staleness": ("stale",),
                   "greso": ("zero_variance",), "mismatch": ("mismatch",)}


def at_stake(rules_: set[str], rows: list[dict], slices: list[tuple], rates: dict[str, float]) -> dict[str, dict]:
    """For each rule in `rules_` with drops to its name (WASTE_ADDRESSED), what they cost per
    100 steps over `rows` (trainer/accounting/cost.py `drops_per_100_steps`, each step's device-
    seconds from `slices`: (step, spans, devices)): device-seconds, and their price at `rates`
    in the mix of device kinds the run holds now."""
    held = next((x[2] for x in reversed(slices) if x[2]), None)
    if not held:
        return {}
    per_step, by_kind = cost.step_device_seconds_by_step(slices), cost.kind_counts(held)
    devices = sum(by_kind.values())
    out = {}
    for rule in sorted(rules_ & set(WASTE_ADDRESSED)):
        device_s = cost.drops_per_100_steps(rows, per_step, WASTE_ADDRESSED[rule])
        if device_s and devices:
            out[rule] = {"reasons": list(WASTE_ADDRESSED[rule]), "device_s": device_s,
                         "price": cost.price({k: device_s * n / devices for k, n in by_kind.items()}, rates)}
    return out


CONFIDENCES = ("low", "medium", "high")
# every value of Advice.rule: one per rule module ("length" is april.py's truncation note)
RULE_FAMILIES = ("staleness", "april", "length", "greso", "health", "mismatch", "episodes")
EVIDENCE_KEY_LEN = 12   # hex digits of Advice.evidence_key


def figure(w: Window, name: str, stat: str = "mean") -> Figure | None:
    """`stat` of metric `name` over the window, with the steps it covers (None: not reported)."""
    steps = w.steps(name)
    if steps is None:
        return None
    value = {"mean": w.mean, "last": w.last}[stat](name)
    return Figure(name, stat, value, steps[0], steps[1])


def derived(name: str, stat: str, value: float, w: Window, source: str) -> Figure:
    """A figure computed from the series of `source` (a share of steps, a half-to-half change)."""
    first, last = w.steps(source) or (0, 0)
    return Figure(name, stat, value, first, last)


def propose(key: str, value: Any) -> Any:
    """`value` for tunable knob `key`, moved inside its declared range (ints rounded). Raises
    ValueError for a key that is not a knob: the rules advise only what can change mid-run."""
    spec = config_mod.param_spec(key)
    if not spec.tunable:
        raise ValueError(f"{key} is not a tunable knob")
    if spec.type in (int, float):
        if spec.min is not None:
            value = max(spec.min, value)
        if spec.max is not None:
            value = min(spec.max, value)
        value = int(round(value)) if spec.type is int else float(value)
    return spec.coerce(value)


def knob_advice(rule: str, reason: str, cfg, key: str, proposed: Any, *, message: str,
                expected: str, confidence: str, evidence: list[Figure | None]) -> Advice | None:
    """Advice to set knob `key` to `proposed` (kept inside its range); None when that is no
    change (the knob is already at its bound)."""
    current = cfg.get(key)
    value = propose(key, proposed)
    if value == current:
        return None
    return Advice(rule, reason, key, current, value, message, expected, confidence,
                  tuple(f for f in evidence if f is not None))


def note_advice(rule: str, reason: str, *, message: str, expected: str, confidence: str,
                evidence: list[Figure | None]) -> Advice:
    """Advice whose move is not a knob (add generation, stop the run, ...)."""
    return Advice(rule, reason, None, None, None, message, expected, confidence,
                  tuple(f for f in evidence if f is not None))
