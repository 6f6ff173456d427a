"""The run lifecycle: the statuses a run moves through and what may move it, in one place.

A run has a status (what its worker last did or the server decided) and a desired state (what
its owner asked for; the worker reads it at step boundaries). Every place that moves either
reads this module: the controls a person uses (actions.runs.control), the trainer's own events
written by the database sink (actions.rows), the worker's start and end (worker/tasks.py,
actions.runs.end_run), the stale-run sweep, the control source that turns the desired state into
trainer commands (worker/telemetry.py), and the pages, which get `allowed_actions` from the server so
the browser holds no copy of the rules. docs/design.md#run-lifecycle draws the diagram.

No Django here: statuses are plain strings (models.Status names the same strings for the
database), so the rules are testable as a table.
"""
from __future__ import annotations

from dataclasses import dataclass

from trainer.run.controls import PAUSE as CMD_PAUSE
from trainer.run.controls import RESUME as CMD_RESUME
from trainer.run.controls import STOP as CMD_STOP

# --- statuses and desired states ---------------------------------------------------------------------

QUEUED, RUNNING, PAUSED, STOPPING = "queued", "running", "paused", "stopping"
STOPPED, FINISHED, FAILED, INTERRUPTED = "stopped", "finished", "failed", "interrupted"
STATUSES = (QUEUED, RUNNING, PAUSED, STOPPING, STOPPED, FINISHED, FAILED, INTERRUPTED)

RUN, PAUSE, STOP = "run", "pause", "stop"
DESIRED = (RUN, PAUSE, STOP)

ACTIVE = (QUEUED, RUNNING, PAUSED, STOPPING)     # counts against the owner's quota; not deletable
LIVE = (RUNNING, PAUSED, STOPPING)               # a worker trains it and should be heartbeating
ENDED = (STOPPED, FINISHED, FAILED, INTERRUPTED)  # the run has a finished_at
RESUMABLE = (STOPPED, FAILED, INTERRUPTED)       # resume re-queues it from its last checkpoint
TUNABLE = (QUEUED, RUNNING, PAUSED)              # knob changes are accepted

# --- a person's actions ------------------------------------------------------------------------------

ACTIONS = ("stop", "pause", "resume", "kill")
KNOBS = "knobs"   # in allowed_actions while knob changes are accepted (not a control action)

# what else an action does besides writing the new status and desired state
REVOKE = "revoke"          # drop the queued training task
TERMINATE = "terminate"    # SIGKILL the worker process training the run
REQUEUE = "requeue"        # send a new training task that resumes from the last checkpoint


@dataclass(frozen=True)
class Transition:
    status: str                          # the run's status afterwards
    desired: str                         # the run's desired state afterwards
    event: str = ""                      # the event that records it besides a status change
    effect: str = ""                     # REVOKE, TERMINATE, REQUEUE or nothing
    when_desired: tuple[str, ...] = ()   # only while the desired state is one of these (any: ())


_REQUEUE = Transition(QUEUED, RUN, effect=REQUEUE)
_KILL = Transition(STOPPED, STOP, event="killed", effect=TERMINATE)

# (status, action) -> what it does. A pair missing here is refused (409). Stop and pause are
# cooperative: the worker finishes its step; its `stop_requested` / `paused` events then move the
# status (EVENT_STATUS). Resume of a paused run, or of a running run whose pause is still pending,
# only changes the desired state.
TRANSITIONS: dict[tuple[str, str], Transition] = {
    (QUEUED, "stop"): Transition(STOPPED, STOP, effect=REVOKE),
    (RUNNING, "stop"): Transition(STOPPING, STOP),
    (PAUSED, "stop"): Transition(STOPPING, STOP),
    (RUNNING, "pause"): Transition(RUNNING, PAUSE, event="pause_requested", when_desired=(RUN,)),
    (RUNNING, "resume"): Transition(RUNNING, RUN, event="resume_requested", when_desired=(PAUSE,)),
    (PAUSED, "resume"): Transition(PAUSED, RUN, event="resume_requested"),
    (STOPPED, "resume"): _REQUEUE,
    (FAILED, "resume"): _REQUEUE,
    (INTERRUPTED, "resume"): _REQUEUE,
    (QUEUED, "kill"): Transition(STOPPED, STOP, event="killed", effect=REVOKE),
    (RUNNING, "kill"): _KILL,
    (PAUSED, "kill"): _KILL,
    (STOPPING, "kill"): _KILL,
}


def default_desired(status: str) -> str:
    """The desired state a run in `status` has unless someone asked otherwise (for records
    written before the desired state was recorded with the status)."""
    return RUN if status in (QUEUED, RUNNING, PAUSED) else STOP


def transition(status: str, desired: str | None, action: str) -> Transition | None:
    """What `action` does to a run in (status, desired), or None when it is refused."""
    t = TRANSITIONS.get((status, action))
    desired = desired or default_desired(status)
    if t is None or (t.when_desired and desired not in t.when_desired):
        return None
    return t


def refusal(status: str, desired: str | None, action: str) -> str:
    """Why `action` is refused for a run in (status, desired), for the person who asked."""
    pending = (status, action) in TRANSITIONS and status == RUNNING
    if pending and action == "pause":
        return f"cannot pause a run that is {status} (a pause or stop is already pending)"
    if pending and action == "resume":
        return f"cannot resume a run that is {status} (no pause is pending)"
    return f"cannot {action} a run that is {status}"


def allowed_actions(status: str, desired: str | None = None) -> list[str]:
    """The actions a run in (status, desired) accepts, in ACTIONS order, then KNOBS when knob
    changes are accepted. The pages enable their buttons from this list."""
    out = [a for a in ACTIONS if transition(status, desired, a) is not None]
    return out + [KNOBS] if status in TUNABLE else out


# --- the trainer's side -----------------------------------------------------------------------------

# the trainer's events that move the status; applied only while the run is LIVE (a run killed or
# interrupted meanwhile keeps that status)
EVENT_STATUS = {"paused": PAUSED, "resumed": RUNNING, "stop_requested": STOPPING}

# the worker picks up a queued run (or refuses it: its own settings do not allow the config)
START_FROM = (QUEUED,)
# the training task's last word on a run, and the sweep's on a run whose worker was lost: only a
# live run takes it
END_FROM = LIVE
WORKER_ENDS = (FINISHED, STOPPED, FAILED, INTERRUPTED)   # interrupted: the worker was shut down
LOST = INTERRUPTED


def status_after_event(kind: str, status: str) -> str | None:
    """The status a trainer event `kind` moves a run in `status` to, or None."""
    new = EVENT_STATUS.get(kind)
    return new if new is not None and status in LIVE else None


# A run marked stopped or killed while its worker still trains it (the kill signal got lost)
# stops cooperatively after this grace period, which lets a kill land first.
ORPHAN_GRACE_S = 5.0

def trainer_command(status: str, desired: str, *, paused: bool, stop_sent: bool,
                    orphaned_s: float | None) -> str | None:
    """The command the control source sends the trainer at a step boundary, or None.

    `paused`: the trainer was told to pause and not yet to resume; `stop_sent`: it was told to
    stop; `orphaned_s`: how long the run's status has not been LIVE while this worker trains it
    (None while it is)."""
    orphaned = orphaned_s is not None and orphaned_s > ORPHAN_GRACE_S
    if not stop_sent and (desired == STOP and status in LIVE or orphaned):
        return CMD_STOP
    if desired == PAUSE and not paused:
        return CMD_PAUSE
    if desired == RUN and paused:
        return CMD_RESUME
    return None
