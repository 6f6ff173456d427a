"""Who may do what with runs: the rules that depend on the user and on the runs they have, not
on the shape of the request (validation.py checks that).

- Queued + running runs per user: at most RLPILOT_MAX_ACTIVE_RUNS_PER_USER (staff exempt), so one
  user cannot fill the workers' queue. The actions layer calls it inside the launch's and the
  resume's transaction.

- Floods: knob changes waiting for one run's step boundary (RLPILOT_MAX_PENDING_KNOB_CHANGES)
  and asked for by one user in a minute (RLPILOT_KNOB_CHANGES_PER_MINUTE), from the page, the
  API or the socket alike; exports one user has in progress at once (RLPILOT_MAX_EXPORTS_PER_USER),
  since a large HTML export costs the server seconds that other users' pages wait for.
- A run's checkpoints seed a new run only for its owner or staff (`model_source_problem`).

Who may control a run (its owner or staff) is `Run.can_control` in models.py, beside the run,
since the pages ask it too.
"""
from __future__ import annotations

import contextlib
import logging
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Callable

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.db import transaction
from django.utils import timezone

from webapp.dashboard.errors import Throttled, TooManyRuns
from webapp.dashboard.models import ACTIVE, KnobChange, Run

log = logging.getLogger(__name__)
EXPORT_SLOT_TTL_S = 600  # a slot whose process died frees itself after this long


def check_active_runs(user) -> None:
    """Raise TooManyRuns when `user` already has RLPILOT_MAX_ACTIVE_RUNS_PER_USER runs queued,
    running, paused or stopping (0 = no limit; staff are exempt). Call it inside the launch's
    transaction: it locks the user's row so two launches at once cannot both pass."""
    limit = settings.RLPILOT_MAX_ACTIVE_RUNS_PER_USER
    if limit <= 0 or user.is_staff:
        return
    if transaction.get_connection().in_atomic_block:
        get_user_model().objects.select_for_update().filter(pk=user.pk).first()
    n = Run.objects.filter(owner=user, status__in=ACTIVE).count()
    if n >= limit:
        raise TooManyRuns(
            "too many active runs", {"runs": (
                f"you have {n} runs queued or running (at most {limit} per user, "
                "RLPILOT_MAX_ACTIVE_RUNS_PER_USER): stop one or wait for one to finish")})


def model_source_problem(user, model_path: str) -> str | None:
    """Why `user` may not start a run from `model_path`, or None. A path inside another run's
    folder (RLPILOT_RUNS_DIR/run-NNNNNN/...: its checkpoints) is that run's weights: only the
    run's owner or staff may copy them into a new run, as only they may control it. Reading a
    run's report stays open to every user; taking its weights does not. A path naming no run
    there (a typo, a deleted run) is refused too rather than guessed."""
    try:
        rel = Path(model_path).resolve().relative_to(settings.RUNS_DIR)
    except (ValueError, OSError):
        return None  # not a run's folder: the model roots decide
    folder = rel.parts[0] if rel.parts else ""
    run_id = int(folder[4:]) if folder.startswith("run-") and folder[4:].isdigit() else None
    run = Run.objects.filter(pk=run_id).first() if run_id is not None else None
    if run is None:
        return "names no run's checkpoint under RLPILOT_RUNS_DIR"
    if not run.can_control(user):
        return (f"the checkpoints of run {run.pk} belong to its owner: only they or staff may "
                "start a run from them")
    return None


def check_knob_rate(run: Run, user) -> None:
    """Raise Throttled when `run` already has RLPILOT_MAX_PENDING_KNOB_CHANGES changes waiting for
    its next step boundary, or `user` asked for RLPILOT_KNOB_CHANGES_PER_MINUTE changes in the
    last minute. Call it inside the change's transaction, after locking the run's row."""
    pending_max = settings.RLPILOT_MAX_PENDING_KNOB_CHANGES
    if pending_max > 0:
        pending = KnobChange.objects.filter(run=run, status=KnobChange.PENDING).count()
        if pending >= pending_max:
            raise Throttled("too many knob changes waiting", {"knobs": (
                f"{pending} changes are waiting for run {run.pk}'s next step boundary (at most "
                f"{pending_max}, RLPILOT_MAX_PENDING_KNOB_CHANGES): wait for them to be applied")})
    per_minute = settings.RLPILOT_KNOB_CHANGES_PER_MINUTE
    if per_minute > 0:
        since = timezone.now() - timedelta(minutes=1)
        recent = KnobChange.objects.filter(requested_by=user, requested_at__gte=since).count()
        if recent >= per_minute:
            raise Throttled("too many knob changes", {"knobs": (
                f"{recent} knob changes in the last minute (at most {per_minute}, "
                "RLPILOT_KNOB_CHANGES_PER_MINUTE): wait a little")})


def take_export_slot(user) -> Callable[[], None]:
    """Take one of `user`'s RLPILOT_MAX_EXPORTS_PER_USER export slots and return what gives it
    back (Throttled when every slot is taken). Slots live in the cache, shared by the web
    processes, and expire after EXPORT_SLOT_TTL_S should a process die holding one; a cache that
    is down lets exports through rather than refusing everybody."""
    limit = settings.RLPILOT_MAX_EXPORTS_PER_USER
    if limit <= 0:
        return _nothing
    token = uuid.uuid4().hex
    try:
        for i in range(limit):
            key = f"rlpilot:export-slot:{user.pk}:{i}"
            if cache.add(key, token, timeout=EXPORT_SLOT_TTL_S):
                return lambda: _give_back(key)
    except Exception:
        log.warning("export slots: cache unavailable", exc_info=True)
        return _nothing
    raise Throttled("too many exports at once", {"format": (
        f"{limit} of your exports are still being prepared (at most {limit} at once, "
        "RLPILOT_MAX_EXPORTS_PER_USER): wait for one to finish")})


def _give_back(key: str) -> None:
    with contextlib.suppress(Exception):
        cache.delete(key)


def _nothing() -> None:
    pass
