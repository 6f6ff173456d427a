"""The pilot's advice on a dashboard run (trainer/pilot/, docs/pilot.md): the run's latest
metric points, read back as the metric rows the rules take, and its config with the knob values
it runs with now, each piece flagged `dismissed` when a person dismissed it (actions/pilot.py).
Read-only: applying a piece of advice is an ordinary knob change, dismissing it an action."""
from __future__ import annotations

from django.db.models import Max

from trainer import config as config_mod
from trainer.pilot import rules
from trainer.pilot.advice import WASTE_ADDRESSED, at_stake
from webapp.dashboard.actions import dismissed_keys
from webapp.dashboard.models import MetricPoint, Run, TimelineSlice
from webapp.dashboard.reports.cost import devices, rates


def latest_rows(run_id: int, steps: int) -> list[dict]:
    """The metric rows ({"step": N, name: value}) of the run's last `steps` steps, oldest first."""
    last = MetricPoint.objects.filter(run_id=run_id).aggregate(last=Max("step"))["last"]
    if last is None:
        return []
    by_step: dict[int, dict] = {}
    points = (MetricPoint.objects.filter(run_id=run_id, step__gt=last - steps)
              .order_by("seq").values_list("step", "key", "value"))
    for step, key, value in points:   # a later point of a step (a resumed run's) wins
        by_step.setdefault(step, {"step": step})[key] = value
    return [by_step[s] for s in sorted(by_step)]


def for_run(run: Run, window: int) -> dict:
    """{"window", "steps": [first, last] or None, "cursor", "advice": [Advice.as_json() +
    {"dismissed"}, ...]}. `cursor`: the run's last sequence number as of the knob values read
    (a knob_applied event past it is not in this advice yet)."""
    cfg = config_mod.apply_overrides(config_mod.from_dict(run.config), run.knobs or {})
    rows = latest_rows(run.pk, window)
    advice = [a.as_json() for a in rules.advise(rows, cfg, window=window)] if rows else []
    priced = {a["rule"] for a in advice if a["rule"] in WASTE_ADDRESSED}
    costs = _drop_costs(run, rows, priced) if priced else {}
    for a in advice:
        a["cost_per_100_steps"] = costs.get(a["rule"])
    if advice:
        dismissed = dismissed_keys(run.pk)
        for a in advice:   # dismissed until the rule's evidence_key changes
            a["dismissed"] = (a["rule"], a["evidence_key"]) in dismissed
    return {"window": window, "steps": [rows[0]["step"], rows[-1]["step"]] if rows else None,
            "cursor": run.last_seq, "advice": advice}


def _drop_costs(run: Run, rows: list[dict], rules_: set[str]) -> dict[str, dict]:
    """What the drops each rule's advice is about cost per 100 steps over the window (pilot/
    advice.py `at_stake`), on the devices the run holds, at its rates."""
    held = devices(run)
    if held is None or not rows:
        return {}
    slices = [(step, spans, held) for step, spans in
              TimelineSlice.objects.filter(run_id=run.pk, step__gte=rows[0]["step"], step__lte=rows[-1]["step"])
              .order_by("seq").values_list("step", "spans")]
    return at_stake(rules_, rows, slices, rates(run))
