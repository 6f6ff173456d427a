"""The data accounting on real runs (trainer/invariants/draws.py): across a resume with a changed
batch size, every position the cursor handed out reaches an outcome once; a driver that forgets
its held groups at a resume is caught as prompts skipped."""
import pytest

from trainer import config as C
from trainer.observe.metrics import MemorySink
from trainer.rollout.synchronous import SynchronousDriver
from trainer.run.runner import Runner

TINY = ["rollout.n_samples_per_prompt=4", "rollout.max_response_len=32", "rollout.max_slots=16",
        "run.reward_workers=0", "model.threads=1", "run.eval_every=0", "run.log_samples=0",
        "run.checkpoint_every=1", "april.enabled=true", "april.segment_max_tokens=4",
        "april.max_version_span=2", "greso.enabled=true"]


def run(tmp_path, overrides, resume=False, keep=()):
    sink = MemorySink()
    with Runner(C.load("demo", TINY + overrides), tmp_path, sink=sink, resume=resume,
                keep_knobs=keep) as r:
        r.run()
    return r, sink


def figures(sink, name):
    return sink.series(f"invariants/{name}")


@pytest.mark.slow
def test_a_resume_with_another_batch_size_skips_and_repeats_nothing(tmp_path):
    first, s1 = run(tmp_path, ["rollout.rollout_batch_size=4", "run.max_steps=2"])
    assert first.rollout.held_draws(), "APRIL holds partial groups across the checkpoint"
    again, s2 = run(tmp_path, ["rollout.rollout_batch_size=2", "run.max_steps=4"], resume=True,
                    keep=("rollout.rollout_batch_size", "run.max_steps"))
    assert again.step == 4
    for sink in (s1, s2):
        assert sum(figures(sink, "prompts_skipped")) == 0
        assert sum(figures(sink, "prompts_repeated")) == 0
    assert not [e for e in s1.events + s2.events if e["kind"] == "invariant_violated"]


@pytest.mark.slow
def test_a_resume_that_forgets_the_held_groups_is_caught(tmp_path, monkeypatch):
    first, _ = run(tmp_path, ["rollout.rollout_batch_size=4", "run.max_steps=2"])
    held = first.rollout.held_draws()
    assert held
    real = SynchronousDriver.load_state_dict

    def forgetful(self, state, version):   # the bug class: the cursor restored, the buffer not
        real(self, {**state, "buffer": {"groups": []}}, version)

    monkeypatch.setattr(SynchronousDriver, "load_state_dict", forgetful)
    _, sink = run(tmp_path, ["rollout.rollout_batch_size=4", "run.max_steps=3"], resume=True)
    (event,) = [e for e in sink.events if e["kind"] == "invariant_violated"
                and e["rule"] == "prompts_skipped"]
    assert sorted(map(int, event["samples"])) == sorted(held)
    assert sum(figures(sink, "prompts_skipped")) == len(held)


@pytest.mark.slow
def test_an_asynchronous_resume_counts_the_queued_groups_scored_before_the_checkpoint(tmp_path):
    # groups scored after the last step and queued at the checkpoint: no step of the resumed
    # run reports their scoring, the step that trains them settles them
    cfg = ["rollout.n_samples_per_prompt=4", "rollout.max_response_len=32", "rollout.max_slots=16",
           "run.reward_workers=0", "model.threads=1", "run.eval_every=0", "run.log_samples=0",
           "run.checkpoint_every=1", "rollout.rollout_batch_size=4"]
    with Runner(C.load("async", cfg + ["run.max_steps=2"]), tmp_path, sink=MemorySink()) as r:
        r.run()
    sink = MemorySink()
    with Runner(C.load("async", cfg + ["run.max_steps=4"]), tmp_path, sink=sink, resume=True,
                keep_knobs=("run.max_steps",)) as r:
        queued = set(r.rollout.held_draws()) & {g.draw for g in r.rollout.state.queue}
        assert queued, "the checkpoint holds scored groups queued for the trainer"
        r.run()
    assert figures(sink, "prompts_skipped") == [0, 0]
    assert sum(figures(sink, "prompts_repeated")) == 0
