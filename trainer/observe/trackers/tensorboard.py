"""TensorBoard: event files in <run_dir>/tensorboard/ (torch's SummaryWriter; needs the
`tensorboard` package). Every scalar by step, the pre-binned histograms, and every event
(knob changes, warnings, errors, checkpoints) as text under events/<kind>."""
from __future__ import annotations

import json
from typing import Any

from trainer.observe.trackers.base import Tracker, numbers


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def start(self) -> dict[str, Any]:
        from torch.utils.tensorboard import SummaryWriter  # raises ImportError without tensorboard

        self.dir = self.run_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.dir))
        return {"url": None, "dir": str(self.dir)}

    def scalars(self, step, values):
        for name, value in numbers(values).items():
            self.writer.add_scalar(name, value, step)

    def histogram(self, step, name, hist):
        edges, counts = hist["edges"], hist["counts"]
        total = sum(counts)
        if not total:
            return
        filled = [i for i, c in enumerate(counts) if c]
        # the sink gets bins, not values: sum and sum of squares from the bin centres
        centres = [(lo + hi) / 2 for lo, hi in zip(edges, edges[1:])]
        self.writer.add_histogram_raw(
            name, min=edges[filled[0]], max=edges[filled[-1] + 1], num=total,
            sum=sum(c * x for c, x in zip(counts, centres)),
            sum_squares=sum(c * x * x for c, x in zip(counts, centres)),
            bucket_limits=list(edges[1:]), bucket_counts=list(counts), global_step=step)

    def event(self, step, kind, data):
        self.writer.add_text(f"events/{kind}", "    " + json.dumps(data, default=str, sort_keys=True), step)

    def flush(self):
        self.writer.flush()

    def close(self):
        self.writer.close()
