"""The synchronous loop end to end on the built-in model: metrics, checkpoints, exact resume,
and knob changes / pause / stop applied at step boundaries."""
import json

import pytest
import torch

from trainer import config as C
from trainer.observe.metrics import JsonlSink, MemorySink, MultiSink
from trainer.run import checkpoint
from trainer.run.controls import PAUSE, RESUME, SET_KNOBS, STOP, Command, ControlSource
from trainer.run.runner import Runner


class ScriptedControls(ControlSource):
    """Returns the commands listed for each poll, in order."""

    def __init__(self, script):
        self.script = list(script)

    def poll(self):
        return self.script.pop(0) if self.script else []


def make(tmp_path, overrides, steps=3, **kw):
    cfg = C.load("demo", overrides + [f"run.max_steps={steps}"])
    sink = MemorySink()
    return Runner(cfg, tmp_path, sink=MultiSink([sink, JsonlSink(tmp_path)]), **kw), sink


def test_three_steps_write_metrics_histograms_events_and_a_checkpoint(tmp_path, tiny_overrides):
    runner, sink = make(tmp_path, tiny_overrides)
    with runner:
        assert runner.run() == "finished"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ["reward/mean", "reward/accuracy", "rollout/response_len/mean",
                "rollout/response_len/p90", "rollout/zero_var_ratio", "rollout/idle_slot_frac",
                "actor/kl", "perf/gen_tokens_per_s", "perf/trained_tokens_per_s", "timing/gen_s",
                "timing/train_s", "system/cpu_util", "system/ram_gb"]:
        assert key in rows[-1], key
    assert rows[-1]["train/samples_total"] == 3 * 4 * 4
    hists = [json.loads(line) for line in (tmp_path / "histograms.jsonl").read_text().splitlines()]
    lengths = [h for h in hists if h["name"] == "rollout/response_len"]
    assert len(lengths) == 3 and sum(lengths[0]["counts"]) == 16
    kinds = [e["kind"] for e in sink.events]
    assert kinds[0] == "run_started" and kinds[-1] == "run_finished" and "checkpoint" in kinds
    # the trainer's precision and the engine's (rollout.dtype auto: the trainer's)
    assert (sink.events[0]["model_dtype"], sink.events[0]["rollout_dtype"]) == ("float32", "float32")
    assert checkpoint.latest(tmp_path).name == "step_000003"


def _weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_resume_continues_exactly_where_the_run_stopped(tmp_path, tiny_overrides):
    straight, _ = make(tmp_path / "a", tiny_overrides, steps=4)
    with straight:
        straight.run()
    first, _ = make(tmp_path / "b", tiny_overrides, steps=2)
    with first:
        first.run()
    resumed, sink = make(tmp_path / "b", tiny_overrides, steps=4, resume=True)
    assert resumed.step == 2 and resumed.prompts.cursor == 2 * 4
    with resumed:
        resumed.run()
    assert resumed.step == 4 and sink.events[0]["kind"] == "run_resumed"
    assert torch.equal(_weights(straight.model), _weights(resumed.model))
    assert resumed.totals == straight.totals


def test_knob_change_is_applied_at_a_step_boundary_and_recorded(tmp_path, tiny_overrides):
    controls = ScriptedControls([[], [Command(SET_KNOBS, knobs={"optim.lr": 5e-5,
                                                                 "rollout.temperature": 0.9},
                                              requested_by="alice")]])
    runner, sink = make(tmp_path, tiny_overrides, controls=controls)
    with runner:
        runner.run()
    applied = [e for e in sink.events if e["kind"] == "knob_applied"]
    assert len(applied) == 1 and applied[0]["step"] == 1
    start_lr = C.load("demo").optim.lr
    assert applied[0]["changes"]["optim.lr"] == {"old": start_lr, "new": 5e-5}
    assert applied[0]["requested_by"] == "alice"
    assert sink.series("actor/lr") == [start_lr, 5e-5, 5e-5]
    state = json.loads((checkpoint.latest(tmp_path) / "state.json").read_text())
    assert state["knobs"]["optim.lr"] == 5e-5 and state["knobs"]["rollout.temperature"] == 0.9


@pytest.mark.parametrize("knobs, key", [({"optim.lr": 7.0}, "optim.lr"),
                                        ({"model.path": "/x"}, "model.path"),
                                        ({"optim.nope": 1}, "optim.nope")])
def test_bad_knob_changes_are_rejected_whole_with_the_reason(tmp_path, tiny_overrides, knobs, key):
    controls = ScriptedControls([[Command(SET_KNOBS, knobs={**knobs, "rollout.top_p": 0.5})]])
    runner, sink = make(tmp_path, tiny_overrides, steps=1, controls=controls)
    with runner:
        runner.run()
    rejected = [e for e in sink.events if e["kind"] == "knob_rejected"]
    assert len(rejected) == 1 and key in rejected[0]["errors"]
    assert runner.cfg.rollout.top_p == 1.0  # nothing of a rejected change is applied
    assert not [e for e in sink.events if e["kind"] == "knob_applied"]


def test_pause_holds_the_run_and_stop_ends_it_with_a_checkpoint(tmp_path, tiny_overrides):
    controls = ScriptedControls([[], [Command(PAUSE)], [], [], [Command(RESUME)], [],
                                 [Command(STOP)]])
    runner, sink = make(tmp_path, tiny_overrides, steps=10, controls=controls)
    with runner:
        assert runner.run() == "stopped"
    kinds = [e["kind"] for e in sink.events]
    assert kinds.index("paused") < kinds.index("resumed") < kinds.index("stop_requested")
    assert runner.step == 3  # paused before step 2, stopped before step 4
    assert checkpoint.latest(tmp_path).name == "step_000003"
    assert kinds[-1] == "run_stopped"


def test_greso_state_survives_checkpoint_and_resume(tmp_path, tiny_overrides):
    extra = ["greso.enabled=true", "rollout.dynamic_sampling=true", "data.train_size=8"]
    first, _ = make(tmp_path, tiny_overrides + extra, steps=3)
    with first:
        first.run()
        saved = first.greso.state_dict()
    assert saved["traces"] and (saved["p_easy"], saved["p_hard"]) != (0.5, 0.5)  # adapted
    again, _ = make(tmp_path, tiny_overrides + extra, steps=4, resume=True)
    with again:
        assert again.greso.state_dict() == saved
        again.run()
    assert again.step == 4


def test_the_runner_says_what_it_does_between_steps(tmp_path, monkeypatch):
    # the dashboard's stall watch reads Runner.phase: set while evaluating and saving, else None
    from trainer.run import runner as runner_mod
    from trainer.run import state as run_state

    seen = []
    real_eval, real_save = runner_mod.evaluate, run_state.save

    def evaluate(*a, **k):
        seen.append(("eval", r.phase))
        return real_eval(*a, **k)

    def save(run):
        seen.append(("save", run.phase))
        return real_save(run)

    monkeypatch.setattr(runner_mod, "evaluate", evaluate)
    monkeypatch.setattr(run_state, "save", save)
    cfg = C.load("demo", ["rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
                          "rollout.max_response_len=16", "run.max_steps=2", "run.eval_every=2",
                          "run.eval_size=4", "run.checkpoint_every=0", "run.reward_workers=0"])
    with Runner(cfg, tmp_path, sink=MemorySink(), system_telemetry=False) as r:
        assert r.phase is None
        r.run()
        assert r.phase is None
    assert seen == [("eval", "evaluating"), ("eval", "evaluating"), ("save", "saving a checkpoint")]


def test_a_run_told_to_stop_mid_step_ends_interrupted_not_failed(tmp_path, tiny_overrides, monkeypatch):
    """Ctrl-C or a worker's shutdown (SystemExit) in step 3: the run's last word is
    `run_interrupted` with the checkpoint a resume continues from, not an `error`, and its
    directory reads as interrupted."""
    from webapp.dashboard.files import run_files

    runner, sink = make(tmp_path, tiny_overrides + ["run.checkpoint_every=2"], steps=5)
    real = runner.train_step

    def train_step():
        if runner.step == 2:
            raise SystemExit(-241)
        return real()

    monkeypatch.setattr(runner, "train_step", train_step)
    with pytest.raises(SystemExit), runner:
        runner.run()
    kinds = [e["kind"] for e in sink.events]
    assert "error" not in kinds and kinds[-1] == "run_interrupted"
    assert sink.events[-1]["resumable_from_step"] == 2
    assert "SystemExit: -241" in sink.events[-1]["message"]
    ending = run_files.inspect(tmp_path).ending
    assert (ending.status, ending.step) == ("interrupted", 2) and "told to stop" in ending.error
