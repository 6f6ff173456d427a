"""Multi-turn, tool-using episodes through real runs of the `agent` preset (the built-in model
warmed up with a calculator): every technique (synchronous, APRIL, GRESO, asynchronous, all) on
the embedded engine and on a pool of generation processes. Each run must have generated real
episodes (tool calls answered, environment tokens appended), never trained an environment token,
and said where every generated token went. APRIL's parked episodes (mid-turn and between turns)
survive a checkpoint and the resumed run is the uninterrupted one."""
from __future__ import annotations

import shutil

import pytest
import torch
from helpers import check_rows

from trainer import config as C
from trainer.engine.base import ENV_VERSION
from trainer.observe.metrics import MemorySink
from trainer.run.runner import Runner

SMALL = ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "rollout.max_slots=16",
         "run.eval_every=0", "run.checkpoint_every=0", "run.reward_workers=0", "model.threads=1",
         "rollout.max_response_len=64", "episode.feedback=true", "data.max_list_len=5"]
MODES = {
    "sync": [],
    "april": ["april.enabled=true", "april.segment_max_tokens=8"],
    "greso": ["greso.enabled=true"],
    "async": ["async.enabled=true", "async.max_staleness=1"],
    "all": ["april.enabled=true", "april.segment_max_tokens=8", "greso.enabled=true",
            "async.enabled=true", "async.max_staleness=1", "rollout.dynamic_sampling=true"],
}


def run(tmp_path, overrides, steps, resume=False):
    cfg = C.load("agent", [*SMALL, *overrides, f"run.max_steps={steps}"])
    sink = MemorySink()
    with Runner(cfg, tmp_path, sink=sink, resume=resume, system_telemetry=False) as runner:
        runner.run()
        held = runner.rollout.held_tokens()
        rollout_tokens = runner.engine.stats.generated_tokens - runner.eval_tokens
    return runner, [r for r in sink.steps if "rollout/tokens/generated" in r], held, rollout_tokens


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["embedded", "pool"])
@pytest.mark.parametrize("mode", list(MODES))
def test_every_technique_trains_on_episodes(tmp_path, mode, engine):
    extra = ["cluster.gen_procs=2"] if engine == "pool" else []
    runner, rows, held, rollout_tokens = run(tmp_path, [*MODES[mode], *extra], steps=3)
    assert runner.step == 3
    # real episodes: tools called and answered, more than one model turn
    assert sum(r.get("episode/tool_calls", 0) for r in rows) > 0
    assert max(r.get("episode/turns/max", 0) for r in rows) > 1
    assert sum(r.get("episode/env_tokens", 0) for r in rows) > 0
    # where every generated token went; environment tokens are none of it
    _, generated, trained, _ = check_rows(rows)
    if not runner.rollout.concurrent:   # (asynchronous: the worker generates past the last step)
        assert generated == rollout_tokens
        assert rows[-1]["rollout/tokens/waiting"] == held
    assert trained <= generated


def parked_both_ways(tmp_path):
    """A 2-step APRIL run whose buffer holds episodes parked mid-turn and between turns, and its
    overrides. With a segment of one token, an episode whose tool call closes in a round spends
    its segment on that token: it is parked in that round with the tool's result as its last
    tokens (and goes on in the next round). So a step that ends at a round limit whose last
    round closes a call leaves such episodes in the buffer: the round limits are tried in turn
    (a run is deterministic) until one does. An episode over in a partial group (its budget
    spent by an environment message) is in the buffer too, but not parked: not counted."""
    for rounds in range(1, 9):
        # a checkpoint holds no KV cache: exact where the parked caches are given up at every
        # update
        april = [*MODES["april"], "april.segment_max_tokens=1", "engine.kv_on_update=recompute",
                 f"rollout.max_sampling_rounds={rounds}"]
        first, _, _, _ = run(tmp_path / "first", april, steps=2)
        parked = [s for s in first.rollout.buffer.samples() if not s.done and s.versions]
        if {s.versions[-1] == ENV_VERSION for s in parked} == {True, False}:
            return april
        shutil.rmtree(tmp_path / "first")
    raise AssertionError("no round limit left episodes parked both mid-turn and between turns")


def test_parked_episodes_survive_a_checkpoint_and_resume_exactly(tmp_path):
    # the guard: the buffer holds episodes parked both ways, so the comparison below proves it
    april = parked_both_ways(tmp_path)
    straight, _, _, _ = run(tmp_path / "straight", april, steps=4)
    shutil.copytree(tmp_path / "first", tmp_path / "resumed")
    resumed, _, _, _ = run(tmp_path / "resumed", april, steps=4, resume=True)
    assert resumed.step == 4
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    assert resumed.totals == straight.totals

    def state(runner):
        return [(list(s.response_ids), list(s.versions), list(s.logprobs),
                 {k: v for k, v in s.meta["episode"].items() if k != "tool_s"})   # (a wall time)
                for s in runner.rollout.buffer.samples()]

    assert state(resumed) == state(straight)
