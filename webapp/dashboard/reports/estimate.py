"""A run's estimate from the runs this dashboard has recorded (trainer/accounting/estimate.py's rule
over the database): the latest runs of the same SHAPE (model, engine and layout, batch,
response limit, techniques, task) give their latest steps' times (steps only, the first left
out) and the devices they held;
the estimate names them. None when no recorded run has that shape (a worker calibrates)."""
from __future__ import annotations

from typing import Any

from trainer import config as config_mod
from trainer.accounting import cost
from trainer.accounting import estimate as estimate_rule
from webapp.dashboard.models import Estimate, Run, TimelineSlice
from webapp.dashboard.reports.cost import devices, rates_of

LOOK_BACK = 200   # the latest runs searched for the same shape
MAX_RUNS = 10     # at most this many of them pooled (the latest)


def from_history(cfg: config_mod.Config) -> dict[str, Any] | None:
    want, found = estimate_rule.shape(cfg), []
    for run in Run.objects.order_by("-pk")[:LOOK_BACK]:
        if len(found) == MAX_RUNS:
            break
        if not isinstance(run.config, dict) or estimate_rule.shape_of(run.config) != want:
            continue
        # its latest steps, steps only (no evaluation or checkpoint), its first (the warm-up) left out
        slices = list(TimelineSlice.objects.filter(run_id=run.pk, step__gt=1).order_by("-seq")
                      .values_list("step", "spans")[:estimate_rule.HISTORY_STEPS + 1])[::-1]
        walls, held = cost.step_walls(slices, steps_only=True)[-estimate_rule.HISTORY_STEPS:], devices(run)
        if walls and held:
            found.append((run, walls, held))
    if not found:
        return None
    found.reverse()   # oldest first: the latest run's devices are the layout's
    return estimate_rule.from_steps(
        [w for _, walls, _ in found for w in walls], found[-1][2], cfg.run.max_steps, rates_of(cfg.to_dict()),
        {"source": "history", "runs": [{"id": r.pk, "name": r.name} for r, _, _ in found]})


def estimate_json(row: Estimate) -> dict[str, Any]:
    return {"id": row.pk, "status": row.status, "url": f"/api/estimates/{row.pk}",
            "created_at": row.created_at.isoformat(), "queue": row.queue,
            "result": row.result, "error": row.error}
