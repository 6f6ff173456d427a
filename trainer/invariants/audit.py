"""A finished run's invariants, audited from its files (`python -m trainer check RUN`).

Two sources, reported side by side per rule (trainer/invariants/rules.py):

- the run's own checks: the `invariants/<rule>` figures of metrics.jsonl, summed, with the steps
  they were above 0 (every trained sample, as the run checked it);
- a recheck of the samples samples.jsonl recorded (`run.log_samples` groups a step, plus the
  longest, shortest and failed ones): a trained row's `staleness` (versions between its oldest
  model token and the policy the step trained) against the bound in force at its step (the
  step's `invariants/bound`, else `async/max_staleness` for an asynchronous run, else
  `fallback_bound`), and each (group, index) trained in one step only. A row cannot show a
  token's loss weight, so `env_loss` has the run's own figure alone.

A resumed run records the steps after its checkpoint again: a step recorded again supersedes
the earlier record (`latest_records`). Pure: rows in, a report out.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from trainer.invariants import RULES

RECHECKED = ("beyond_eta", "beyond_span", "trained_twice")


@dataclass
class RuleReport:
    rule: str
    recorded: int | None = None        # the run's own count (None: the run did not check)
    recorded_steps: list[int] = field(default_factory=list)
    rechecked: int | None = None       # the recorded samples' count (None: not rechecked)
    rechecked_steps: list[int] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)   # "step:group/index" of the first offenders

    @property
    def broken(self) -> bool:
        return bool(self.recorded) or bool(self.rechecked)


def latest_records(rows: list[dict]) -> list[dict]:
    """The rows of each step's last record: a row whose step is below the previous row's starts
    a resumed run's records again, which supersede those from that step on."""
    out: list[dict] = []
    for row in rows:
        step = row.get("step")
        if not isinstance(step, int):
            continue
        if out and step < out[-1]["step"]:
            out = [r for r in out if r["step"] < step]
        out.append(row)
    return out


def recorded_counts(metric_rows: list[dict]) -> dict[str, RuleReport]:
    """Each rule's sum of its invariants/<rule> figures, with the steps it was above 0."""
    reports = {rule: RuleReport(rule) for rule in RULES}
    for row in latest_records(metric_rows):
        for rule in RULES:
            n = row.get(f"invariants/{rule}")
            if not isinstance(n, (int, float)):
                continue
            rep = reports[rule]
            rep.recorded = (rep.recorded or 0) + int(n)
            if n > 0:
                rep.recorded_steps.append(row["step"])
    return reports


def bounds_by_step(metric_rows: list[dict], asynchronous: bool, fallback_bound: int | None) -> dict[int, int | None]:
    """The token-age bound in force at each step the metrics record."""
    out = {}
    for row in latest_records(metric_rows):
        bound = row.get("invariants/bound")
        if not isinstance(bound, (int, float)) and asynchronous:
            bound = row.get("async/max_staleness")
        out[row["step"]] = int(bound) if isinstance(bound, (int, float)) else fallback_bound
    return out


def recheck(sample_rows: list[dict], bounds: dict[int, int | None], age_rule: str,
            reports: dict[str, RuleReport], max_ids: int = 20) -> None:
    """The recorded trained samples against the bounds and each other, into `reports`."""
    age, twice = reports[age_rule], reports["trained_twice"]
    age.rechecked, twice.rechecked = 0, 0
    trained_at: dict[tuple, int] = {}
    seen_in_step: set[tuple] = set()
    for row in latest_records(sample_rows):
        if not row.get("trained"):
            continue
        step, key = row["step"], (row.get("group"), row.get("index"))
        if (step, key) in seen_in_step:   # the same sample picked twice in one record: one row
            continue
        seen_in_step.add((step, key))
        name = f"{step}:{key[0]}/{key[1]}"
        bound = bounds.get(step)
        staleness = row.get("staleness")
        if bound is not None and isinstance(staleness, int) and staleness > bound:
            age.rechecked += 1
            _note(age, step, name, max_ids)
        if key in trained_at and trained_at[key] != step:
            twice.rechecked += 1
            _note(twice, step, f"{name} (trained at step {trained_at[key]} too)", max_ids)
        trained_at.setdefault(key, step)


def _note(rep: RuleReport, step: int, name: str, max_ids: int) -> None:
    if not rep.rechecked_steps or rep.rechecked_steps[-1] != step:
        rep.rechecked_steps.append(step)
    if len(rep.samples) < max_ids:
        rep.samples.append(name)


def audit(metric_rows: list[dict], sample_rows: list[dict], asynchronous: bool,
          fallback_bound: int | None) -> list[RuleReport]:
    """Every rule's report, in RULES order. `fallback_bound`: the config's bound, for steps that
    recorded none (a run from before the checks; knob changes are then not seen)."""
    reports = recorded_counts(metric_rows)
    age_rule = "beyond_eta" if asynchronous else "beyond_span"
    recheck(sample_rows, bounds_by_step(metric_rows, asynchronous, fallback_bound), age_rule, reports)
    return [reports[rule] for rule in RULES]
