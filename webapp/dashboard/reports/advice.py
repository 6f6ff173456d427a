"""The pilot's advice on a dashboard run (trainer/pilot/, docs/pilot.md): the run's latest
metric points, read back as the metric rows the rules take, and its config with the knob values
it runs with now, each piece flagged `dismissed` when a person dismissed it (actions/pilot.py);
and APRIL's rules of thumb beside the run's values, as the run page shows them (`april_context`,
the figures trainer/pilot/april.py computes). Read-only: applying a piece of advice is an
ordinary knob change, dismissing it an action."""
from __future__ import annotations

from django.db.models import Max

from trainer import config as config_mod
from trainer.pilot import april, rules
from trainer.pilot.advice import WASTE_ADDRESSED, at_stake
from webapp.dashboard.actions import dismissed_keys
from webapp.dashboard.formatting import number
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


def current_config(run: Run):
    """The run's config with the knob values it runs with now."""
    return config_mod.apply_overrides(config_mod.from_dict(run.config), run.knobs or {})


def april_context(run: Run) -> str | None:
    """APRIL's rules of thumb beside the run's values, as one line for the run page's tuning
    panel (None when APRIL is off): N' against 1.5-2x the batch, the segment limit against the
    response lengths so far (the longest of the run, the latest p90), the buffer in tokens against
    the write-up's sizing rule (the latest mean length)."""
    launched = (run.config or {}).get("april") or {}
    if not (run.knobs or {}).get("april.enabled", launched.get("enabled")):
        return None
    cfg = current_config(run)
    points = MetricPoint.objects.filter(run_id=run.pk)
    longest = points.filter(key="rollout/response_len/max").aggregate(m=Max("value"))["m"] or 0

    def latest(key: str) -> float | None:
        return points.filter(key=key).order_by("-seq").values_list("value", flat=True).first()
    p90, mean, buffer = latest("rollout/response_len/p90"), latest("rollout/response_len/mean"), \
        latest("april/buffer_tokens")
    f = april.rule_figures(cfg, longest, mean)
    lo, hi = f["rule"]
    parts = [f"N′ {f['over_sampling']} is {f['ratio']:.1f}x the batch of {f['batch']} ({lo:g}–{hi:g}x)"]
    if f["longest"]:
        lengths = (f"p90 {number(p90)}, " if p90 is not None else "") + f"longest {number(f['longest'])}"
        parts.append(f"segment limit {f['segment']} against responses of {lengths} tokens (first at half "
                     f"the longest: {f['first_segment']}, then from the idle slots)")
    else:
        parts.append(f"segment limit {f['segment']} (no response lengths yet)")
    if buffer is not None:
        parts.append(f"buffer {number(buffer)} tokens" + (
            f" against the sizing rule's {number(f['buffer_sizing'])} (mean length {number(mean)} × "
            f"{f['over_sampled_samples']} over-sampled samples ÷ the throughput gain, taken as 1)"
            if f["buffer_sizing"] is not None else ""))
    return "APRIL's rules of thumb: " + " · ".join(parts)


def for_run(run: Run, window: int) -> dict:
    """{"window", "steps": [first, last] or None, "cursor", "advice": [Advice.as_json() +
    {"dismissed"}, ...]}. `cursor`: the run's last sequence number as of the knob values read
    (a knob_applied event past it is not in this advice yet)."""
    cfg = current_config(run)
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
