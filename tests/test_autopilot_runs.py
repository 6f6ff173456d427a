"""The autopilot on a real run: the `async` preset started at a deliberately poor eta = 0 (the
synchronous loop) with the autopilot on for the staleness rule. It raises eta inside its bounds, no
more often than pilot.every, each change a knob_applied event by "autopilot" with its evidence;
a person's change to eta later wins and is never moved again. The undo guards are driven through
the real StepBoundary in tests/test_autopilot.py."""
from __future__ import annotations

import json

import pytest

from trainer import config as config_mod
from trainer.observe.metrics import JsonlSink
from trainer.run.controls import SET_KNOBS, Command, ControlSource
from trainer.run.runner import Runner

ETA = "async.max_staleness"
PERSON_AFTER = 11


class PersonAt(ControlSource):
    """alice's eta = 1, read once the run has finished PERSON_AFTER steps."""

    def __init__(self):
        self.runner, self.sent = None, False

    def poll(self):
        if self.sent or self.runner is None or self.runner.step < PERSON_AFTER:
            return []
        self.sent = True
        return [Command(SET_KNOBS, knobs={ETA: 1}, requested_by="alice")]


@pytest.mark.slow
def test_the_autopilot_lifts_a_poor_eta_within_bounds_and_a_persons_change_wins(tmp_path):
    cfg = config_mod.load("async", [f"{ETA}=0", "pilot.autopilot=staleness", "pilot.every=3",
                                    f"pilot.bounds={ETA}=0..2", "run.max_steps=16", "run.eval_every=0",
                                    "run.checkpoint_every=8", "run.log_samples=0"])
    controls = PersonAt()
    with Runner(cfg, tmp_path, sink=JsonlSink(tmp_path), controls=controls, system_telemetry=False,
                log=lambda *a: None) as runner:
        controls.runner = runner
        assert runner.run() == "finished"
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    applied = [e for e in events if e["kind"] == "knob_applied"]
    mine = [e for e in applied if e["requested_by"] == "autopilot"]
    person = [e for e in applied if e["requested_by"] == "alice"]

    assert mine, "the autopilot never moved eta from 0: nothing below is proven"
    assert mine[0]["changes"][ETA] == {"old": 0, "new": 1}
    assert mine[0]["reason"]["rule"] == "staleness" and mine[0]["reason"]["evidence"]
    advised = [e for e in events if e["kind"] == "advice" and e["knob"] == ETA]
    assert advised[0]["evidence_key"] == mine[0]["reason"]["evidence_key"]   # announced, then applied
    steps = [e["step"] for e in mine]
    assert all(b - a >= 3 for a, b in zip(steps, steps[1:])), steps
    etas = [r["async/max_staleness"] for r in rows]
    assert max(etas) <= 2 and all(0 <= e["changes"][ETA]["new"] <= 2 for e in mine)
    # alice's eta = 1 after step 11 stands: the autopilot leaves eta alone from then on
    assert len(person) == 1 and person[0]["step"] >= PERSON_AFTER
    # (at the boundary it came to, a change of the autopilot's applies first: the person's last)
    assert all(events.index(e) < events.index(person[0]) for e in mine)
    assert etas[-1] == 1 and runner.cfg.get(ETA) == 1
    # the staleness the trainer measured follows the knob: eta raised is eta used
    raised_from = mine[0]["step"] + 1
    assert max(r["async/staleness/max"] for r in rows if r["step"] > raised_from) >= 1
