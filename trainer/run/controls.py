"""Control sources: how knob changes, pause, resume and stop reach a running trainer.

The trainer polls its `ControlSource` at every step boundary (and while paused, and while an
asynchronous step waits for groups, so a stop or pause is seen within a second) and applies
what it gets at the boundary, so a change never lands in the middle of a step. The web app
supplies a database-backed source; the CLI uses `FileControlSource`, a folder of JSON command
files that `python -m trainer control RUN_DIR ...` writes. The trainer's own knob changes
(`async.auto_staleness`) are commands too, from `requested_by="auto"`, queued at the boundary, and
so are the autopilot's ("autopilot") and async.staleness_schedule's points ("schedule").
"""
from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SET_KNOBS, PAUSE, RESUME, STOP = "set_knobs", "pause", "resume", "stop"
COMMANDS = (SET_KNOBS, PAUSE, RESUME, STOP)
AUTO = "auto"  # requested_by of the trainer's own knob changes (async.auto_staleness)
AUTOPILOT = "autopilot"  # requested_by of the autopilot's (trainer/pilot/autopilot.py)
SCHEDULE = "schedule"  # requested_by of async.staleness_schedule's points
AUTOMATIC = (AUTO, AUTOPILOT, SCHEDULE)   # not a person's


@dataclass
class Command:
    kind: str                                    # one of COMMANDS
    knobs: dict[str, Any] = field(default_factory=dict)  # for set_knobs: dotted key -> value
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    requested_by: str = "cli"
    requested_at: float = field(default_factory=time.time)
    # why an automatic change was asked for (the rule and the figures it saw); kept in the event
    reason: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "knobs": self.knobs, "id": self.id,
                "requested_by": self.requested_by, "requested_at": self.requested_at,
                **({"reason": self.reason} if self.reason else {})}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Command":
        if d.get("kind") not in COMMANDS:
            raise ValueError(f"unknown command kind {d.get('kind')!r}; expected one of {COMMANDS}")
        knobs = d.get("knobs") or {}
        if not isinstance(knobs, dict):
            raise ValueError("'knobs' must be an object of dotted keys to values")
        return cls(kind=d["kind"], knobs=knobs, id=str(d.get("id") or uuid.uuid4().hex[:12]),
                   requested_by=str(d.get("requested_by", "cli")),
                   requested_at=float(d.get("requested_at", time.time())),
                   reason=d["reason"] if isinstance(d.get("reason"), dict) else {})


class ControlSource:
    def poll(self) -> list[Command]:
        """Commands received since the last poll, oldest first."""
        return []


class FileControlSource(ControlSource):
    """Commands are JSON files in RUN_DIR/control/; consumed files move to control/done/."""

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir) / "control"
        (self.dir / "done").mkdir(parents=True, exist_ok=True)

    def poll(self) -> list[Command]:
        out = []
        for path in sorted(self.dir.glob("*.json")):
            try:
                cmd = Command.from_json(json.loads(path.read_text()))
            except (ValueError, json.JSONDecodeError) as e:
                path.rename(self.dir / "done" / (path.name + ".invalid"))
                (self.dir / "done" / (path.name + ".error")).write_text(str(e) + "\n")
                continue
            path.rename(self.dir / "done" / path.name)
            out.append(cmd)
        return out


def send(run_dir: str | Path, command: Command) -> Path:
    """Write a command for a run (atomically: readers never see half a file)."""
    d = Path(run_dir) / "control"
    if not d.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no control/ folder)")
    name = f"{time.time_ns():020d}-{command.id}.json"
    tmp = d / ("." + name + ".tmp")
    tmp.write_text(json.dumps(command.to_json()))
    os.replace(tmp, d / name)
    return d / name
