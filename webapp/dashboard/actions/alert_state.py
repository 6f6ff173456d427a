"""A run's active alerts, and runs whose worker was lost.

The alert rules (worker/alerts.py) and the stale-run sweep (worker/sweep.py) call these and
hand them what they decide (the change to the active alerts, the heartbeat alert), so this
package never imports them. Both write under the run's row lock: the database sink writes the
same row.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, Callable

from django.db import transaction

from webapp.dashboard import lifecycle
from webapp.dashboard.actions.rows import Record, append, status_record
from webapp.dashboard.models import Run


def change_alerts(run_id: int, change: Callable[[dict], Any], record: Record | None = None) -> int | None:
    """Apply `change` to the run's active alerts (a dict it edits in place) and append `record`
    (an alert / alert_cleared event, or None for a silent fix of the banner state), under the row
    lock. None when the run is gone."""
    with transaction.atomic():
        state = Run.objects.select_for_update().filter(pk=run_id).values_list("alerts", flat=True).first()
        if state is None:
            return None
        state = dict(state or {})
        active = dict(state.get("active") or {})
        change(active)
        return append(run_id, [record] if record else [], {"alerts": {**state, "active": active}})


def clear_alert(run: Run, rule: str) -> None:
    """Clear `rule` from the run's active alerts, with an alert_cleared event, if it is on."""
    state = Run.objects.filter(pk=run.pk).values_list("alerts", flat=True).first() or {}
    if rule in (state.get("active") or {}):
        change_alerts(run.pk, lambda active: active.pop(rule, None),
                      Record("event", run.step, "alert_cleared", {"rule": rule}))


def interrupt_lost_run(run_id: int, heartbeat_before: datetime, error: str,
                       alert: Callable[[Run], tuple[Record, dict]]) -> bool:
    """A live run whose last heartbeat is older than `heartbeat_before` (its worker disappeared)
    becomes `interrupted`, and `alert(run)` (the heartbeat rule of alerts.py: a record and the
    run's new alert state, from the row as locked here) is appended with it, in one write. False
    when the run is gone, no longer live, or beat again meanwhile. Called by the sweep."""
    with transaction.atomic():
        run = (Run.objects.select_for_update().only("id", "status", "step", "alerts", "heartbeat_at")
               .filter(pk=run_id).first())
        if (run is None or run.status not in lifecycle.END_FROM or run.heartbeat_at is None
                or run.heartbeat_at >= heartbeat_before):
            return False
        rec, state = alert(run)
        append(run_id, [status_record(lifecycle.LOST, run.step, error), rec],
               {"error": error, "alerts": state})
    return True
