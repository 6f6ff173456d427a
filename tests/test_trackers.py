"""run.report_to: a run mirrored to TensorBoard, W&B (offline) and MLflow, each read back with
the tracker's own reader; a tracker that is missing or raises is one warning event and the run's
own metrics are those of the same seeded run without it; the mirror never holds training."""
from __future__ import annotations

import importlib.util
import json
import math
import struct
import sys
import threading
import time

import pytest

from trainer import config as C
from trainer.observe.metrics import JsonlSink, MemorySink, MetricsSink, MultiSink
from trainer.observe.trackers.base import Tracker
from trainer.observe.trackers.mirror import TrackerMirror
from trainer.observe.trackers.tensorboard import TensorBoardTracker
from trainer.run.controls import SET_KNOBS, Command, ControlSource
from trainer.run.runner import Runner

# metrics that depend on the clock or the machine, not on the seed
UNSEEDED = ("timing/", "perf/", "system/", "proc/", "time", "cost/")


def needs(package: str):
    return pytest.mark.skipif(importlib.util.find_spec(package) is None,
                              reason=f"the {package} package is not installed (pip install -e '.[trackers]')")


class KnobAtStep(ControlSource):
    """One knob change, read at the first step boundary."""

    def __init__(self):
        self.sent = False

    def poll(self):
        if self.sent:
            return []
        self.sent = True
        return [Command(SET_KNOBS, knobs={"optim.lr": 5e-5}, requested_by="alice")]


def run(tmp_path, tiny_overrides, report_to: str, steps: int = 3, controls=None, resume=False):
    cfg = C.load("demo", tiny_overrides + [f"run.max_steps={steps}", f"run.report_to={report_to}"])
    sink = MemorySink()
    with Runner(cfg, tmp_path, sink=MultiSink([sink, JsonlSink(tmp_path)]), controls=controls,
                system_telemetry=False, resume=resume) as runner:
        assert runner.run() == "finished"
    return sink


def jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def seeded(rows):
    return [{k: v for k, v in r.items() if not k.startswith(UNSEEDED)} for r in rows]


# --- the config and the mirror ------------------------------------------------------------------

def test_report_to_is_a_validated_list():
    assert C.Config().run.report_to == []
    assert C.load("demo", ["run.report_to=tensorboard, mlflow"]).run.report_to == ["tensorboard", "mlflow"]
    assert C.load("demo", ['run.report_to=["wandb"]']).run.report_to == ["wandb"]
    cfg = C.load("demo", ["run.report_to=wandb,mlflow"])
    assert C.loads_toml(C.to_toml(cfg)).run.report_to == ["wandb", "mlflow"]
    with pytest.raises(C.ConfigError, match="run.report_to: unknown name 'tensorbored'"):
        C.load("demo", ["run.report_to=tensorbored"])
    with pytest.raises(C.ConfigError, match="run.report_to: 'wandb' is named twice"):
        C.load("demo", ["run.report_to=wandb,wandb"])
    with pytest.raises(C.ConfigError, match="run.report_to: got 3"):
        C.from_dict({"run": {"report_to": 3}})


class Recording(Tracker):
    name = "recording"

    def __init__(self, block: threading.Event | None = None, fail_on: str = ""):
        self.block, self.fail_on, self.calls = block, fail_on, []

    def start(self):
        if self.fail_on == "start":
            raise PermissionError("API key refused")
        return {"url": "https://example.org/run/1", "dir": None}

    def scalars(self, step, values):
        if self.block is not None:
            self.block.wait()
        if self.fail_on == "scalars":
            raise OSError("disk full")
        self.calls.append(("scalars", step, values))

    def close(self):
        self.calls.append(("close",))


def test_a_full_queue_drops_for_that_tracker_only_and_says_so_once():
    gate = threading.Event()
    slow, fast, report = Recording(block=gate), Recording(), MemorySink()
    slow.name, fast.name = "slow", "fast"
    mirror = TrackerMirror([slow, fast], report, queue_size=3)
    waited = 0.0
    for step in range(1, 21):
        t0 = time.monotonic()
        mirror.scalars(step, {"x": step})
        waited += time.monotonic() - t0
        time.sleep(0.02)   # a step's pace: the fast tracker keeps up
    assert waited < 0.5    # training never waited on the blocked tracker
    gate.set()
    mirror.close()
    warnings = [e for e in report.events if e["kind"] == "warning"]
    assert len(warnings) == 1 and warnings[0]["message"].startswith("tracker slow falls behind")
    closed = [e for e in report.events if e["kind"] == "trackers_closed"]
    assert closed[0]["dropped_records"].keys() == {"slow"} and 0 < closed[0]["dropped_records"]["slow"] < 20
    assert [c[1] for c in fast.calls if c[0] == "scalars"] == list(range(1, 21))
    assert fast.calls[-1] == ("close",)


def test_close_waits_a_bounded_time_for_a_hung_tracker():
    hung, report = Recording(block=threading.Event()), MemorySink()   # never set
    mirror = TrackerMirror([hung], report, close_timeout_s=0.5)
    mirror.scalars(1, {"x": 1.0})
    t0 = time.monotonic()
    mirror.close()
    assert time.monotonic() - t0 < 3.0
    assert [e["message"] for e in report.events if e["kind"] == "warning"] == [
        "tracker recording did not finish within 0.5 s; the run ends without waiting for it"]


def test_refused_credentials_are_one_warning_and_the_url_is_reported():
    refused, fine, report = Recording(fail_on="start"), Recording(), MemorySink()
    mirror = TrackerMirror([refused, fine], report)
    for step in (1, 2, 3):
        mirror.scalars(step, {"x": 1.0})
    mirror.close()
    kinds = [(e["kind"], e.get("tracker")) for e in report.events]
    assert kinds.count(("warning", "recording")) == 1
    warning = next(e for e in report.events if e["kind"] == "warning")
    assert "start failed: PermissionError: API key refused" in warning["message"]
    started = [e for e in report.events if e["kind"] == "tracker_started"]
    assert started == [{"step": started[0]["step"], "kind": "tracker_started", "tracker": "recording",
                        "url": "https://example.org/run/1", "dir": None}]


# --- real runs ----------------------------------------------------------------------------------

@needs("tensorboard")
def test_tensorboard_holds_every_steps_scalars_histograms_and_the_knob_change(tmp_path, tiny_overrides):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = run(tmp_path, tiny_overrides, "tensorboard", controls=KnobAtStep())
    started = [e for e in sink.events if e["kind"] == "tracker_started"]
    assert started[0]["tracker"] == "tensorboard" and started[0]["dir"] == str(tmp_path / "tensorboard")
    acc = EventAccumulator(str(tmp_path / "tensorboard"),
                           size_guidance={"scalars": 0, "histograms": 0, "tensors": 0}).Reload()
    rows = jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    tags = acc.Tags()
    for row in rows:
        for name, value in row.items():
            if name in ("step", "time") or not isinstance(value, (int, float)):
                continue
            points = {e.step: e.value for e in acc.Scalars(name)}
            assert points[row["step"]] == pytest.approx(value, rel=1e-6, abs=1e-6), name
    hists = jsonl(tmp_path / "histograms.jsonl")
    assert {h["name"] for h in hists} <= set(tags["histograms"])
    for name in {h["name"] for h in hists}:
        written = {h["step"]: h for h in hists if h["name"] == name}
        read = {e.step: e.histogram_value for e in acc.Histograms(name)}
        assert sorted(read) == sorted(written)
        for step, h in written.items():
            assert list(read[step].bucket) == h["counts"], (name, step)
            assert list(read[step].bucket_limit) == pytest.approx(h["edges"][1:])
            assert read[step].num == sum(h["counts"])
    text = acc.Tensors("events/knob_applied/text_summary")
    assert len(text) == 1 and b"optim.lr" in text[0].tensor_proto.string_val[0]


def _wandb_records(path):
    """The records of a .wandb file, decoded with wandb's own protobuf schema. wandb 0.31 ships
    no Python reader of the file (its Go core reads it): the framing below is its LevelDB-style
    log, 32 KiB blocks of [crc32c:4][length:2][type:1] chunks after a 7-byte ':W&B' header."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:          # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:   # zero padding
            pos += left
            continue
        if pos + 7 + length > len(data):   # a chunk still being written
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):    # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


@needs("wandb")
def test_wandb_offline_by_default_holds_the_metrics_and_the_config(tmp_path, tiny_overrides, monkeypatch):
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))          # no ~/.netrc key
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "home" / "cache"))
    sink = run(tmp_path / "run", tiny_overrides, "wandb", controls=KnobAtStep())
    started = next(e for e in sink.events if e["kind"] == "tracker_started")
    assert started["mode"] == "offline" and started["url"] is None
    assert not [e for e in sink.events if e["kind"] == "warning"]
    files = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    # wandb's core process writes the file on its own schedule: finish() may return first
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "exit" not in [
            r.WhichOneof("record_type") for r in _wandb_records(files[0])]:
        time.sleep(0.5)
    history: dict[int, dict] = {}
    config = {}
    for record in _wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history.setdefault(record.history.step.num, {}).update(items)
        elif kind == "run":
            config = {i.key: json.loads(i.value_json) for i in record.run.config.update}
    rows = jsonl(tmp_path / "run" / "metrics.jsonl")
    kinds = [r.WhichOneof("record_type") for r in _wandb_records(files[0])]
    applied = next(e for e in sink.events if e["kind"] == "knob_applied")
    assert history.pop(applied["step"])["knob/optim.lr"] == pytest.approx(5e-5)   # before step 1
    assert sorted(history) == [r["step"] for r in rows] == [1, 2, 3], kinds
    for row in rows:
        for name, value in row.items():
            if name not in ("step", "time") and isinstance(value, (int, float)):
                assert history[row["step"]][name] == pytest.approx(value), name
    hists = [h for h in jsonl(tmp_path / "run" / "histograms.jsonl") if h["name"] == "rollout/response_len"]
    assert len(hists) == 3
    for h in hists:
        assert history[h["step"]]["rollout/response_len/_type"] == "histogram"
        assert history[h["step"]]["rollout/response_len/values"] == h["counts"]
        assert history[h["step"]]["rollout/response_len/bins"] == pytest.approx(h["edges"])
    assert config["run"]["report_to"] == ["wandb"] and config["rollout"]["rollout_batch_size"] == 4


@needs("mlflow")
def test_mlflow_local_store_holds_metrics_by_step_params_and_the_config(tmp_path, tiny_overrides, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    sink = run(tmp_path, tiny_overrides, "mlflow", controls=KnobAtStep())
    assert not [e for e in sink.events if e["kind"] == "warning"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    (mlrun,) = client.search_runs([client.get_experiment_by_name("rlpilot").experiment_id])
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == tmp_path.name
    rows = jsonl(tmp_path / "metrics.jsonl")
    for name in ("reward/mean", "reward/accuracy", "actor/kl", "timing/step_s"):
        history = {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, name)}
        assert history == {r["step"]: pytest.approx(r[name]) for r in rows}, name
    assert [m.value for m in client.get_metric_history(mlrun.info.run_id, "knob/optim.lr")] == [5e-5]
    assert mlrun.data.params["rollout.rollout_batch_size"] == "4"
    assert mlrun.data.params["run.report_to"] == '["mlflow"]'
    config = client.download_artifacts(mlrun.info.run_id, "config.toml", str(tmp_path / "dl"))
    assert C.loads_toml(open(config).read()).run.max_steps == 3

    run(tmp_path, tiny_overrides, "mlflow", steps=4, resume=True)   # the same MLflow run goes on
    (resumed,) = client.search_runs([mlrun.info.experiment_id])
    assert resumed.info.run_id == mlrun.info.run_id and resumed.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(mlrun.info.run_id, "reward/mean")] == [1, 2, 3, 4]


def test_a_missing_package_is_one_warning_and_training_goes_on(tmp_path, tiny_overrides, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)   # `import wandb` raises ImportError
    sink = run(tmp_path, tiny_overrides, "wandb", steps=2)
    warnings = [e for e in sink.events if e["kind"] == "warning"]
    assert len(warnings) == 1 and warnings[0]["tracker"] == "wandb"
    assert warnings[0]["message"].startswith("tracker wandb disabled: its package is not installed (")
    assert warnings[0]["message"].endswith("install it with pip install 'rlpilot[wandb]'")
    assert [r["step"] for r in jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


@needs("tensorboard")
def test_a_tracker_raising_on_every_write_is_one_warning_and_changes_no_metric(tmp_path, tiny_overrides,
                                                                            monkeypatch):
    plain = run(tmp_path / "plain", tiny_overrides, "")

    def broken(self, *args):
        raise OSError("no space left on device")

    for method in ("scalars", "histogram", "event", "flush"):
        monkeypatch.setattr(TensorBoardTracker, method, broken)
    mirrored = run(tmp_path / "mirrored", tiny_overrides, "tensorboard")
    warnings = [e for e in mirrored.events if e["kind"] == "warning"]
    assert len(warnings) == 1
    assert warnings[0]["message"].startswith("tracker tensorboard disabled: ")
    assert "OSError: no space left on device" in warnings[0]["message"]
    assert seeded(mirrored.steps) == seeded(plain.steps)
    assert len(mirrored.steps) == 3 and all(not math.isnan(r["reward/mean"]) for r in mirrored.steps)
    assert mirrored.histograms == plain.histograms


def test_an_empty_report_to_adds_no_sink(tmp_path, tiny_overrides):
    cfg = C.load("demo", tiny_overrides + ["run.max_steps=1"])
    sink = MetricsSink()
    runner = Runner(cfg, tmp_path, sink=sink, system_telemetry=False)
    assert runner.trackers is None and runner.sink is sink
    runner.close()
