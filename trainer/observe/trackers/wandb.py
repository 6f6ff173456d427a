"""Weights & Biases (the `wandb` package). The mode comes from WANDB_MODE; without it, a run is
online only when an API key is configured (WANDB_API_KEY or `wandb login`), else offline: the
run is written under <run_dir>/wandb/ and `wandb sync` uploads it later. The config goes with
the run, every scalar by step, the histograms, knob changes as knob/<key> by step (and the
run's config updated). A resumed run continues the same W&B run (its id is kept in
<run_dir>/wandb/rlpilot_run_id)."""
from __future__ import annotations

import os
import secrets
from typing import Any

from trainer.observe.trackers.base import Tracker, knob_changes, numbers

PROJECT = "rlpilot"   # unless WANDB_PROJECT names another


class WandbTracker(Tracker):
    name = "wandb"

    def start(self) -> dict[str, Any]:
        import wandb

        root = self.run_dir / "wandb"
        root.mkdir(parents=True, exist_ok=True)
        id_file = root / "rlpilot_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id)
        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or PROJECT, dir=str(self.run_dir),
            id=run_id, resume="allow", name=self.run_dir.name, mode=self._mode(wandb),
            config=self.cfg.to_dict(), reinit="create_new",
            settings=wandb.Settings(console="off", silent=True))
        online = not self.run.offline
        return {"url": self.run.url if online else None, "dir": self.run.dir, "mode":
                "online" if online else "offline"}

    @staticmethod
    def _mode(wandb) -> str:
        if os.environ.get("WANDB_MODE"):
            return os.environ["WANDB_MODE"]
        # no network call (verify=False): a key in the environment or ~/.netrc (`wandb login`)
        return "online" if wandb.login(prompt=False, verify=False) else "offline"

    def scalars(self, step, values):
        self.run.log(numbers(values), step=step)

    def histogram(self, step, name, hist):
        self.run.log({name: self.wandb.Histogram(np_histogram=(hist["counts"], hist["edges"]))}, step=step)

    def event(self, step, kind, data):
        knobs = knob_changes(kind, data)
        if knobs:
            self.run.log({f"knob/{k}": v for k, v in knobs.items() if isinstance(v, (int, float))},
                         step=step)
            self.run.config.update({"knobs": knobs}, allow_val_change=True)

    def close(self):
        self.run.finish()
