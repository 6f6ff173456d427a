"""Mirrors of a run to outside trackers (`run.report_to`): TensorBoard, W&B, MLflow.

    mirror = trackers.build(cfg, run_dir, report=sink)   # None when run.report_to is empty

mirror.py holds the background thread every tracker runs on; one module per tracker holds its
adapter, which imports the tracker's optional package only when the run starts it (a missing
package is a warning event, not an error). The Runner builds the mirror, so the CLI and the
dashboard's runs mirror alike.
"""
from __future__ import annotations

from pathlib import Path

from trainer import config as config_mod
from trainer.observe.metrics import MetricsSink
from trainer.observe.trackers.base import Tracker
from trainer.observe.trackers.mirror import TrackerMirror


def adapter(name: str) -> type[Tracker]:
    if name == "tensorboard":
        from trainer.observe.trackers.tensorboard import TensorBoardTracker
        return TensorBoardTracker
    if name == "wandb":
        from trainer.observe.trackers.wandb import WandbTracker
        return WandbTracker
    if name == "mlflow":
        from trainer.observe.trackers.mlflow import MlflowTracker
        return MlflowTracker
    raise ValueError(f"unknown tracker {name!r}; trackers: {', '.join(config_mod.TRACKERS)}")


def build(cfg: config_mod.Config, run_dir: str | Path, report: MetricsSink) -> TrackerMirror | None:
    """The mirror of run.report_to's trackers, reporting its warnings to `report`; None if none."""
    if not cfg.run.report_to:
        return None
    return TrackerMirror([adapter(name)(cfg, Path(run_dir)) for name in cfg.run.report_to], report)
