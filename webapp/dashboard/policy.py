"""Who may do what with runs: the rules that depend on the user and on the runs they have, not
on the shape of the request (validation.py checks that).

- Queued + running runs per user: at most RLPILOT_MAX_ACTIVE_RUNS_PER_USER (staff exempt), so one
  user cannot fill the workers' queue. The actions layer calls it inside the launch's and the
  resume's transaction.

Who may control a run (its owner or staff) is `Run.can_control` in models.py, beside the run,
since the pages ask it too.
"""
from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction

from webapp.dashboard.errors import TooManyRuns
from webapp.dashboard.models import ACTIVE, Run


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
