"""The pilot inside a running trainer (the controller, rank 0): it keeps the run's recent metric
rows, announces each piece of advice when it appears (an `advice` event: the dashboard's panel,
the report and events.jsonl read it) and asks the autopilot for its move."""
from __future__ import annotations

from collections import deque

from trainer import config as config_mod
from trainer.pilot.advice import Advice
from trainer.pilot.autopilot import Autopilot, Move, advice_for
from trainer.pilot.thresholds import DEFAULT, Thresholds

# rows kept: the rules' window, and the autopilot's guard windows (pilot.every before and after
# a change; pilot.every is at most 500)
MAX_ROWS = 1000


class LivePilot:
    def __init__(self, thresholds: Thresholds = DEFAULT):
        self.thresholds = thresholds
        self.rows: deque[dict] = deque(maxlen=MAX_ROWS)
        self.autopilot = Autopilot(thresholds)
        self.announced: dict[str, int] = {}   # evidence_key -> the step it was last announced at

    def after_step(self, step: int, metrics: dict, cfg: config_mod.Config) -> tuple[list[Advice], Move | None]:
        """(advice to announce: new, or not announced for a window of steps; the autopilot's
        move or None) after `step`, whose metrics are `metrics`."""
        self.rows.append({"step": step, **metrics})
        rows = list(self.rows)
        advice = advice_for(rows, cfg, self.thresholds)
        fresh = [a for a in advice
                 if step - self.announced.get(a.evidence_key, -self.thresholds.window - 1)
                 > self.thresholds.window]
        for a in fresh:
            self.announced[a.evidence_key] = step
        return fresh, self.autopilot.decide(step, rows, cfg, advice)

    def state_dict(self, cfg: config_mod.Config) -> dict:
        keep = max(self.thresholds.window, 2 * cfg.pilot.every)
        return {"rows": list(self.rows)[-keep:], "announced": dict(self.announced),
                "autopilot": self.autopilot.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        self.rows.clear()
        self.rows.extend(d.get("rows") or [])
        self.announced = {str(k): int(v) for k, v in (d.get("announced") or {}).items()}
        self.autopilot.load_state_dict(d.get("autopilot") or {})
