"""The pilot's advice on the live page (docs/pilot.md): the marker of a knob change made from a
piece of advice ("Apply"), and dismissing a piece of advice ("Dismiss"), recorded as an
`advice_dismissed` event. Which advice is current is computed by the caller (webapp/dashboard/
advice.py reads the run's metrics) and handed in: this package imports no module that calls it."""
from __future__ import annotations

import re
from typing import Any

from django.db import transaction

from trainer.pilot.advice import EVIDENCE_KEY_LEN, RULE_FAMILIES
from webapp.dashboard.access import validation
from webapp.dashboard.actions.rows import Record, append
from webapp.dashboard.errors import Conflict, Forbidden, Invalid
from webapp.dashboard.models import Run, RunEvent

MARKER_FIELDS = ("rule", "reason", "evidence_key")
_REASON = re.compile(r"^[a-z][a-z0-9_]{0,63}$")        # e.g. eta_starves_generation
_KEY = re.compile(rf"^[0-9a-f]{{{EVIDENCE_KEY_LEN}}}$")
KEY_HELP = f"the advice's evidence_key ({EVIDENCE_KEY_LEN} hex digits, as GET /api/runs/<id>/advice gives it)"


def _field_problems(value: dict, fields: tuple[str, ...]) -> dict[str, str]:
    """Per-field problems of the advice fields in `value` (rule, reason, evidence_key)."""
    errors = {}
    for name in fields:
        v = value.get(name)
        if not isinstance(v, str):
            errors[name] = f"required: a string, got {validation.clip(repr(v), 40)}"
        elif name == "rule" and v not in RULE_FAMILIES:
            errors[name] = (f"unknown rule {validation.clip(repr(v), 40)}; expected one of "
                            + ", ".join(RULE_FAMILIES))
        elif name == "reason" and not _REASON.match(v):
            errors[name] = "expected the advice's reason, e.g. eta_starves_generation (lower case, digits, _)"
        elif name == "evidence_key" and not _KEY.match(v):
            errors[name] = f"expected {KEY_HELP}"
    return errors


def advice_marker(value: Any) -> dict[str, str] | None:
    """A knob change's `advice` ({rule, reason, evidence_key}) checked, or None without one.
    Raises Invalid naming each bad field (errors keyed `advice.<field>`)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise Invalid("the advice marker is malformed", {"advice": (
            'expected {"rule", "reason", "evidence_key"} of the advice the change applies')})
    errors = {f"advice.{k}": v for k, v in _field_problems(value, MARKER_FIELDS).items()}
    for k in sorted(set(value) - set(MARKER_FIELDS)):
        errors[f"advice.{validation.clip(k, 40)}"] = "unknown field; expected rule, reason, evidence_key"
    if errors:
        raise Invalid("the advice marker is malformed", errors)
    return {k: value[k] for k in MARKER_FIELDS}


def dismissed_keys(run_id: int) -> set[tuple[str, str]]:
    """(rule, evidence_key) of every piece of advice dismissed on the run."""
    out = set()
    for data in RunEvent.objects.filter(run_id=run_id, kind="advice_dismissed").values_list("data", flat=True):
        d = data if isinstance(data, dict) else {}
        out.add((str(d.get("rule")), str(d.get("evidence_key"))))
    return out


def dismiss_advice(run: Run, user, rule: Any, evidence_key: Any, current: list[dict]) -> dict[str, Any]:
    """Record that `user` dismissed the piece of advice (rule, evidence_key) among `current` (the
    run's advice now, Advice.as_json() each): an `advice_dismissed` event with what it advised.
    The advice API hides it until that rule's evidence_key changes. Dismissing it again records
    nothing. Returns the event's data and whether it was new."""
    if not run.can_control(user):
        raise Forbidden("only the run's owner or staff can dismiss its advice")
    errors = _field_problems({"rule": rule, "evidence_key": evidence_key}, ("rule", "evidence_key"))
    if errors:
        raise Invalid("the advice to dismiss is malformed", errors)
    found = next((a for a in current if a.get("rule") == rule and a.get("evidence_key") == evidence_key), None)
    if found is None:
        raise Conflict(f"the run has no current advice of rule {rule} with evidence_key {evidence_key}: "
                       "the advice changed since it was read; read it again",
                       {"evidence_key": "not among the run's current advice"})
    data = {"rule": rule, "evidence_key": evidence_key, "reason": found.get("reason"),
            "knob": found.get("knob"), "current": found.get("current"), "proposed": found.get("proposed"),
            "message": found.get("message"), "requested_by": user.get_username()}
    with transaction.atomic():
        Run.objects.select_for_update().filter(pk=run.pk).first()   # one dismissal of a key at a time
        if (rule, evidence_key) in dismissed_keys(run.pk):
            return {"dismissed": data, "new": False}
        run.refresh_from_db(fields=["step"])
        append(run.pk, [Record("event", run.step, "advice_dismissed", data)])
    return {"dismissed": data, "new": True}
