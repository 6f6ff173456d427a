"""A property of every preset: whatever live knob changes and schedules move the bounds (eta, the
version span, N', the segment limit, the in-flight cap, dynamic sampling, GRESO), each at a step
boundary drawn by a seeded RNG, the invariant checks (trainer/invariants/rules.py) find nothing
to report, at the bounds in force at each step."""
import random

import pytest

from trainer import config as C
from trainer.observe.metrics import MemorySink
from trainer.run.controls import SET_KNOBS, Command, ControlSource
from trainer.run.runner import FINISHED, Runner

TINY = ["rollout.rollout_batch_size=3", "rollout.n_samples_per_prompt=4", "rollout.max_response_len=24",
        "rollout.max_slots=16", "run.reward_workers=0", "model.threads=1", "run.eval_every=0",
        "run.checkpoint_every=0", "run.log_samples=0", "run.max_steps=4", "run.stop_on_violation=true",
        "data.train_size=64", "async.collect_timeout_s=60"]
RULES = ("beyond_eta", "beyond_span", "trained_twice", "env_loss", "weights_not_applied")


def moves(cfg, rng: random.Random) -> dict:
    """One random change of the knobs that bound what a step trains, valid for `cfg`."""
    n = cfg.rollout.rollout_batch_size
    choices = [{"rollout.dynamic_sampling": rng.random() < 0.5}, {"greso.enabled": rng.random() < 0.5}]
    if cfg.async_.enabled:
        choices += [{"async.max_staleness": rng.randint(0, 3)},
                    {"async.max_inflight": rng.choice([0, 4, 16])}]
    if cfg.april.enabled:
        choices += [{"april.over_sampling_batch_size": rng.choice([0, n, 2 * n, 3 * n])},
                    {"april.segment_max_tokens": rng.choice([0, 4, 8, 16])}]
        if not cfg.async_.enabled:
            choices.append({"april.max_version_span": rng.randint(0, 3)})
    return rng.choice(choices)


class RandomKnobs(ControlSource):
    """At each step boundary, with probability 0.7, one random knob change (seeded)."""

    def __init__(self, seed: int):
        self.rng, self.runner, self.done_at = random.Random(seed), None, set()

    def poll(self):
        step = self.runner.step
        if step in self.done_at:
            return []
        self.done_at.add(step)
        if self.rng.random() >= 0.7:
            return []
        return [Command(SET_KNOBS, knobs=moves(self.runner.cfg, self.rng), requested_by="property")]


@pytest.mark.slow
@pytest.mark.parametrize("preset, seed, extra", [
    ("demo", 0, []), ("april", 1, ["april.segment_max_tokens=8", "april.max_version_span=1"]),
    ("april", 2, ["april.segment_max_tokens=4", "april.max_version_span=0"]),
    ("async", 3, ["async.staleness_schedule=0:0, 2:2"]), ("async", 4, ["april.enabled=true"]),
    ("all", 5, ["async.staleness_schedule=1:1, 3:0", "april.segment_max_tokens=8"]),
])
def test_random_live_knob_changes_break_no_invariant(tmp_path, preset, seed, extra):
    cfg = C.load(preset, TINY + extra + [f"run.seed={seed}"])
    controls, sink = RandomKnobs(seed), MemorySink()
    with Runner(cfg, tmp_path, sink=sink, controls=controls) as r:
        controls.runner = r
        assert r.run() == FINISHED   # run.stop_on_violation would stop it at the first one
    broken = [e for e in sink.events if e["kind"] == "invariant_violated"]
    assert broken == []
    for rule in RULES:
        assert sink.series(f"invariants/{rule}") == [0.0] * 4, rule
    # the property is about changes: each seed's run applied some
    assert [e for e in sink.events if e["kind"] == "knob_applied" and e["requested_by"] == "property"]
