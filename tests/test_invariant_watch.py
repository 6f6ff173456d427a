"""The runner's invariant checks (trainer/run/invariant_watch.py): the bound in force, the
trained samples as the objective weighs them, and a real run's figures, event and stop."""
import json
from types import SimpleNamespace

import pytest

from trainer import config as C
from trainer.cli.main import main
from trainer.config import ConfigError
from trainer.engine.base import ENV_VERSION, Sample
from trainer.observe.metrics import JsonlSink, MemorySink, MultiSink
from trainer.rollout.base import Group
from trainer.run import checkpoint, invariant_watch
from trainer.run.runner import STOPPED, Runner
from trainer.tasks.base import Problem

TINY = ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
        "rollout.max_response_len=32", "rollout.max_slots=16", "run.reward_workers=0",
        "model.threads=1", "run.eval_every=0", "run.log_samples=0"]


@pytest.mark.parametrize("overrides, rule, bound", [
    ([], "beyond_span", 0),
    (["april.enabled=true", "april.max_version_span=2"], "beyond_span", 2),
    (["april.enabled=true", "april.span_policy=keep"], "beyond_span", None),
    (["async.enabled=true", "async.max_staleness=3"], "beyond_eta", 3),
])
def test_the_bound_in_force(overrides, rule, bound):
    b = invariant_watch.bounds(C.load("demo", overrides), version=7)
    assert (b.version, b.rule, b.max_age) == (7, rule, bound)


def test_trained_samples_take_the_objective_s_weights_and_the_sample_s_versions():
    s0 = Sample([1], response_ids=[4, 5, 6], versions=[3, ENV_VERSION, 3])
    s1 = Sample([1], response_ids=[7], versions=[3])
    g = Group(Problem("p0", "q", 1, "sum"), [s0, s1], draw=11)
    seq = SimpleNamespace(response_ids=s0.response_ids, weights=[1.0, 0.0, 1.0])
    (t,) = invariant_watch.trained_samples([seq], [g])
    assert (t.id, t.versions, t.weights) == ("11/0", (3, ENV_VERSION, 3), (1.0, 0.0, 1.0))
    stray = SimpleNamespace(response_ids=[7], weights=[1.0])   # equal, but not the sample's list
    with pytest.raises(LookupError, match="matches no sample"):
        invariant_watch.trained_samples([stray], [g])


def test_stop_on_violation_needs_the_checks():
    with pytest.raises(ConfigError, match="run.check_invariants"):
        C.load("demo", ["run.stop_on_violation=true", "run.check_invariants=false"])


@pytest.mark.slow
def test_a_healthy_run_reports_zeros_and_its_checkpoint_keeps_the_trained_ids(tmp_path):
    sink = MemorySink()
    cfg = C.load("demo", TINY + ["run.max_steps=2", "run.log_samples=2"])
    with Runner(cfg, tmp_path, sink=MultiSink([sink, JsonlSink(tmp_path)])) as r:
        assert r.run() == "finished"
    for rule in ("beyond_eta", "beyond_span", "trained_twice", "env_loss"):
        assert sink.series(f"invariants/{rule}") == [0.0, 0.0]
    assert not [e for e in sink.events if e["kind"] == "invariant_violated"]
    state, _ = checkpoint.load(checkpoint.latest(tmp_path))
    groups = state["invariants"]["groups"]
    assert groups and all(ix for _, ix in groups)
    # its files audited (python -m trainer check): all held; a doctored sample file is not
    assert main(["check", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    trained = next(r for r in rows if r["trained"])
    rows.append({**trained, "step": 2})   # step 2 trains step 1's sample again
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["check", str(tmp_path)]) == 1


@pytest.mark.slow
def test_a_broken_bound_is_an_event_a_figure_and_with_stop_on_violation_a_stop(tmp_path, monkeypatch):
    real = invariant_watch.bounds

    def impossible(cfg, version):   # no token may be even 0 versions old: every one breaks it
        return real(cfg, version).__class__(version, "beyond_span", -1)

    monkeypatch.setattr(invariant_watch, "bounds", impossible)
    sink = MemorySink()
    cfg = C.load("demo", TINY + ["run.max_steps=3", "run.stop_on_violation=true"])
    with Runner(cfg, tmp_path, sink=sink) as r:
        assert r.run() == STOPPED
        stopped_at = r.step
    # the first step that trains a sample breaks it (a step of zero-variance groups trains none)
    (event,) = [e for e in sink.events if e["kind"] == "invariant_violated"]
    assert event["rule"] == "beyond_span" and event["step"] == stopped_at and event["samples"]
    assert sink.series("invariants/beyond_span")[-1] == event["count"] > 0
    (stop,) = [e for e in sink.events if e["kind"] == "stop_requested"]
    assert stop["requested_by"] == "invariants" and stop["reason"]["rule"] == "beyond_span"
    assert f"beyond_span at step {stopped_at}" in stop["reason"]["message"]


@pytest.mark.slow
def test_an_april_driver_that_skips_the_span_check_is_caught(tmp_path, monkeypatch):
    """The class of a driver bug: buffered groups carried over without their version span checked
    (here every span reads 0 to the driver) are trained past april.max_version_span = 0."""
    monkeypatch.setattr("trainer.rollout.april.version_span", lambda sample, version: 0)
    sink = MemorySink()
    cfg = C.load("april", TINY + ["run.max_steps=4", "april.over_sampling_batch_size=8",
                                  "april.segment_max_tokens=4", "april.max_version_span=0"])
    with Runner(cfg, tmp_path, sink=sink) as r:
        r.run()
    assert sum(sink.series("invariants/beyond_span")) > 0
    assert {e["rule"] for e in sink.events if e["kind"] == "invariant_violated"} == {"beyond_span"}


@pytest.mark.slow
def test_environment_tokens_carrying_loss_are_caught_on_real_episodes(tmp_path, monkeypatch):
    """Multi-turn episodes (the agent preset): their tool results carry no loss, and an objective
    that forgot to mask them is caught (env_loss)."""
    small = ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "run.reward_workers=0",
             "model.threads=1", "run.eval_every=0", "run.log_samples=0", "run.max_steps=2"]
    healthy = MemorySink()
    with Runner(C.load("agent", small), tmp_path / "ok", sink=healthy) as r:
        r.run()
    assert healthy.series("invariants/env_loss") == [0.0, 0.0]
    monkeypatch.setattr("trainer.algo.objective._mask_environment", lambda seqs, samples: None)
    broken = MemorySink()
    with Runner(C.load("agent", small), tmp_path / "bad", sink=broken) as r:
        r.run()
    assert sum(broken.series("invariants/env_loss")) > 0
    assert "env_loss" in {e["rule"] for e in broken.events if e["kind"] == "invariant_violated"}
