"""MLflow (the `mlflow-skinny` package is enough, `mlflow` works too). The store is
MLFLOW_TRACKING_URI when set, else a local SQLite store in <run_dir>/mlruns/ (mlflow.db, the
artifacts beside it; MLflow 3 refuses its old file store unless told otherwise). The flattened
config as params, the config as the artifact config.toml, every finite scalar by step, knob
changes as knob/<key> by step. A resumed run continues the same MLflow run (its id is kept in
<run_dir>/mlruns/rlpilot_run_id). Histograms are not mirrored: MLflow has no histogram type."""
from __future__ import annotations

import json
import os
import time
from typing import Any

from trainer import config as config_mod
from trainer.observe.trackers.base import Tracker, finite, flat_config, knob_changes, numbers

EXPERIMENT = "rlpilot"      # unless MLFLOW_EXPERIMENT_NAME names another
MAX_PARAM_LEN = 6000        # MLflow refuses longer param values (a long system prompt)
BATCH = 100                 # params per log_batch call (MLflow's limit)
METRICS_BATCH = 1000        # metrics per log_batch call (MLflow's limit)


class MlflowTracker(Tracker):
    name = "mlflow"

    def start(self) -> dict[str, Any]:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        local = self.run_dir / "mlruns"
        local.mkdir(parents=True, exist_ok=True)
        remote = os.environ.get("MLFLOW_TRACKING_URI")
        uri = remote or f"sqlite:///{local.resolve() / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or EXPERIMENT
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            exp_id = exp.experiment_id
        elif remote:
            exp_id = self.client.create_experiment(name)
        else:   # the artifacts beside the local database
            exp_id = self.client.create_experiment(name, artifact_location=(local / "artifacts").resolve().as_uri())
        id_file = local / "rlpilot_run_id"
        if id_file.is_file():   # a resumed run: the same MLflow run
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(exp_id, run_name=self.run_dir.name).info.run_id
            id_file.write_text(self.run_id)
            params = [Param(k, _param_value(v)) for k, v in flat_config(self.cfg).items()]
            for i in range(0, len(params), BATCH):
                self.client.log_batch(self.run_id, params=params[i:i + BATCH])
        self.client.log_text(self.run_id, config_mod.to_toml(self.cfg), "config.toml")
        url = None
        if uri.startswith(("http://", "https://")):
            url = f"{uri.rstrip('/')}/#/experiments/{exp_id}/runs/{self.run_id}"
        return {"url": url, "dir": None if remote else str(local)}

    def scalars(self, step, values):
        self._metrics(step, finite(numbers(values)))

    def event(self, step, kind, data):
        knobs = knob_changes(kind, data)
        self._metrics(step, {f"knob/{k}": float(v) for k, v in knobs.items()
                             if isinstance(v, (int, float))})

    def _metrics(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), METRICS_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + METRICS_BATCH])

    def close(self):
        self.client.set_terminated(self.run_id)


def _param_value(v) -> str:
    text = json.dumps(v) if isinstance(v, list) else str(v)
    return text if len(text) <= MAX_PARAM_LEN else text[:MAX_PARAM_LEN - 20] + "... (cut)"
