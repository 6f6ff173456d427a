"""Every metric the trainer reports is declared once (trainer/observe/metric_names.py), and every chart
of the dashboard names declared metrics."""
from pathlib import Path

import pytest

from trainer import config as C
from trainer.observe import metric_names
from trainer.observe.metrics import MemorySink
from trainer.run.runner import Runner

TINY = ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
        "rollout.max_response_len=48", "rollout.max_slots=16", "run.reward_workers=0",
        "model.threads=1", "run.checkpoint_every=0", "run.eval_every=2", "run.max_steps=2",
        "run.eval_size=8", "april.segment_max_tokens=16", "algo.overlong_buffer=16"]


def _missing(preset: str) -> str | None:
    """Why an opt-in preset cannot run here (its model directory is absent: `make test` makes
    SmolLM2's), or None."""
    path = C.preset_dict(preset).get("model", {}).get("path", "builtin")
    return C.preset_requires(preset) if not Path(path).is_dir() else None


@pytest.mark.slow
@pytest.mark.parametrize("preset", [  # an opt-in preset without its model directory: skipped, saying why
    pytest.param(p, marks=pytest.mark.skip(reason=_missing(p))) if _missing(p) else p
    for p in C.preset_names()])
def test_every_reported_name_is_declared(tmp_path, preset):
    extra = ["rollout.dynamic_sampling=true", "algo.overlong_penalty=true"]
    cfg = C.load(preset, TINY + extra)
    sink = MemorySink()
    with Runner(cfg, tmp_path, sink=sink) as r:
        r.run()
    reported = {k for row in sink.steps for k in row if k != "step"}
    assert reported and not [k for k in reported if not metric_names.declared(k)]
    hists = {h["name"] for h in sink.histograms}
    assert hists <= set(metric_names.HISTOGRAM_AXES), hists - set(metric_names.HISTOGRAM_AXES)


def test_charts_name_declared_metrics():
    for chart in metric_names.CHARTS:
        keys = chart.get("keys", []) + chart.get("fallback", {}).get("keys", [])
        assert all(metric_names.declared(k) for k in keys), chart["id"]
        if chart.get("type") in ("hist", "heat"):
            assert chart["name"] in metric_names.HISTOGRAM_AXES, chart["id"]
        if "prefix" in chart:
            assert any(k.startswith(chart["prefix"]) for k in metric_names.SCALARS), chart["id"]
    assert len({c["id"] for c in metric_names.CHARTS}) == len(metric_names.CHARTS)
