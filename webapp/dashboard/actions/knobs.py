"""Knob changes a person asks for: validated against the schema and the run's current config,
queued as a pending change the control source hands the trainer at its next step boundary
(where the trainer validates the whole change again and records `knob_applied` or
`knob_rejected`; actions.rows turns the change's row with that event). A change made from the
pilot's advice carries its marker (actions/pilot.py) all the way to that event."""
from __future__ import annotations

import uuid
from typing import Any

from django.db import transaction
from django.db.models import F

from trainer import config as config_mod
from webapp.dashboard import lifecycle
from webapp.dashboard.access import policy, validation
from webapp.dashboard.actions.pilot import advice_marker
from webapp.dashboard.actions.rows import Record, append
from webapp.dashboard.errors import Conflict, Forbidden, Invalid
from webapp.dashboard.models import KnobChange, Run


def validate_knobs(run: Run, knobs: Any) -> dict[str, Any]:
    """The change's values, coerced, as the trainer will apply them: config.apply_knob_change
    (every key known, tunable, in range; the whole config still valid) on the run's current
    config, its launch config with the knobs it runs with now."""
    if not isinstance(knobs, dict) or not knobs:
        raise Invalid("expected an object of knob names to values", {"knobs": "expected a non-empty "
                      'object of dotted keys to values, e.g. {"optim.lr": 5e-5}'})
    try:
        current = config_mod.apply_overrides(config_mod.from_dict(run.config), run.knobs or {})
        _, changes = config_mod.apply_knob_change(current, knobs)
    except config_mod.ConfigError as e:
        raise Invalid("knob change refused", validation.clip_errors(_say_not_a_knob(e.errors, knobs))) from None
    return {key: change["new"] for key, change in changes.items()}


def _say_not_a_knob(errors: dict[str, str], knobs: dict[str, Any]) -> dict[str, str]:
    """The errors, a requested key that is a parameter but no knob saying so (a person asked for
    it; the trainer's "cannot change during a run" alone does not say why)."""
    return {key: f"{message} (not a knob)" if key in knobs and _fixed_parameter(key) else message
            for key, message in errors.items()}


def _fixed_parameter(key: str) -> bool:
    """A parameter of the schema that cannot change during a run (an unknown key is none)."""
    try:
        return not config_mod.param_spec(key).tunable
    except config_mod.ConfigError:
        return False


def request_knobs(run: Run, user, knobs: Any, advice: Any = None) -> KnobChange:
    """Queue a knob change: its row, the run's knob_version (what the control source watches)
    and the `knob_requested` event, in one transaction. `advice`: the {rule, reason,
    evidence_key} of the advice the change applies (the live page's Apply), kept on the row and
    in the event; the control source hands it to the trainer as the command's reason."""
    if not run.can_control(user):
        raise Forbidden("only the run's owner or staff can change its knobs")
    if run.status not in lifecycle.TUNABLE:
        raise Conflict(f"the run is {run.status}; knobs can change only while it is queued, "
                       "running or paused")
    marker = advice_marker(advice)
    values = validate_knobs(run, knobs)
    with transaction.atomic():
        Run.objects.select_for_update().filter(pk=run.pk).first()  # one flood check at a time
        policy.check_knob_rate(run, user)
        change = KnobChange.objects.create(run=run, change_id=uuid.uuid4().hex[:12], knobs=values,
                                           requested_by=user, advice=marker)
        data = {"change_id": change.change_id, "knobs": values, "requested_by": user.get_username()}
        if marker:
            data["advice"] = marker
        append(run.pk, [Record("event", run.step, "knob_requested", data)],
               {"knob_version": F("knob_version") + 1})
    return change
