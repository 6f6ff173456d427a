"""The rollout inspector's record (trainer/accounting/inspector.py): which samples a step keeps, what each row
says, that runs write them through every sink, and the `samples` command."""
from __future__ import annotations

import json
import random

import pytest
from helpers import TINY_RUN

from trainer import config as config_mod
from trainer.accounting.inspector import finish, pick, segments
from trainer.cli import main as cli
from trainer.engine.base import LENGTH, STOP, Sample
from trainer.observe.metrics import JsonlSink, MemorySink, MultiSink
from trainer.rollout.base import Group
from trainer.run.controls import SET_KNOBS, Command, ControlSource
from trainer.run.runner import Runner
from trainer.tasks.base import Problem


def make_group(draw: int, lengths: list[int], statuses=None) -> Group:
    samples = [Sample([1, 2], response_ids=[5] * n, logprobs=[-0.5] * n, versions=[0] * n,
                      finish_reason=STOP) for n in lengths]
    g = Group(problem=Problem(id=f"p{draw}", prompt=f"p{draw}", answer="1", kind="sum"), samples=samples, draw=draw)
    g.rewards = g.raw_scores = [1.0 if i % 2 else 0.0 for i in range(len(lengths))]
    g.reward_status = statuses or ["ok"] * len(lengths)
    return g


def test_pick_takes_whole_groups_the_extremes_and_every_failed_reward():
    groups = [make_group(0, [3, 4]), make_group(1, [9, 2]),
              make_group(2, [5, 5], statuses=["ok", "timeout"]), make_group(3, [6, 7])]
    picks = pick(groups, 1, random.Random(0))
    why = {(g.draw, k): w for g, k, w in picks}
    whole = [d for d in range(4) if why.get((d, 0)) == "group" and why.get((d, 1)) == "group"]
    assert len(whole) == 1                                       # one group, both members
    assert why[(2, 1)] == "error"                                # the timed-out reward
    assert why.get((1, 0)) in ("longest", "group") and why.get((1, 1)) in ("shortest", "group")
    assert len(picks) == len(set(why))                           # nobody twice
    assert len(picks) <= 2 + 2 + 1                               # G*n + 2 + failed rewards
    assert pick(groups, 0, random.Random(0)) == []               # run.log_samples = 0: none


def test_pick_is_reproducible_per_seed():
    groups = [make_group(d, [d + 1, d + 2]) for d in range(10)]
    a = [(g.draw, k) for g, k, _ in pick(groups, 2, random.Random(7))]
    b = [(g.draw, k) for g, k, _ in pick(groups, 2, random.Random(7))]
    assert a == b


def test_segments_are_runs_of_one_policy_version():
    assert segments([0, 0, 1, 1, 1, 3]) == [[0, 2], [1, 3], [3, 1]]
    assert segments([]) == []


def test_finish_reasons():
    s = Sample([1], response_ids=[2, 3], logprobs=[0, 0], versions=[4, 4], finish_reason=STOP)
    assert finish(s) == "stop"
    s.finish_reason = LENGTH
    assert finish(s) == "length"
    s.versions = [3, 4]                      # parked under version 3, finished under 4
    assert finish(s) == "partial"


class KnobsAt(ControlSource):
    """Sets run.log_samples=0 at the boundary before step `at` (the runner polls between
    boundaries too, while an asynchronous step waits: the step decides, not the poll count)."""

    def __init__(self, at: int):
        self.at, self.sent, self.runner = at, False, None

    def poll(self):
        if self.sent or self.runner is None or self.runner.step < self.at - 1:
            return []
        self.sent = True
        return [Command(SET_KNOBS, knobs={"run.log_samples": 0})]


@pytest.mark.parametrize("preset,extra", [("april", []), ("async", []),
                                          ("async", ["async.prox_logp=recompute"])],
                         ids=["april", "async-loglinear", "async-recompute"])
def test_a_run_records_bounded_rows_that_tell_each_samples_story(tmp_path, preset, extra):
    cfg = config_mod.load(preset, [*TINY_RUN, "run.max_steps=4", "april.segment_max_tokens=8",
                                   "run.log_samples=1", *extra])
    memory = MemorySink()
    sink = MultiSink([memory, JsonlSink(tmp_path)])
    controls = KnobsAt(4)
    with Runner(cfg, tmp_path, sink=sink, controls=controls, system_telemetry=False) as r:
        controls.runner = r
        r.run()
    sink.close()
    rows = memory.sample_rows
    steps = {row["step"] for row in rows}
    assert steps == {1, 2, 3}                 # the knob turned recording off before step 4
    n = cfg.rollout.n_samples_per_prompt
    for step in steps:
        assert len([x for x in rows if x["step"] == step]) <= n + 2
    for row in rows:
        assert row["length"] == len(row["tokens"]) == len(row["logprobs"])
        assert sum(t for _, t in row["segments"]) == row["length"]
        assert row["finish"] in ("stop", "length", "partial")
        assert row["reward_status"] == "ok" and row["prompt"]
        assert row["staleness"] == row["step"] - 1 - min(v for v, _ in row["segments"])
        assert "".join(row["tokens"]).replace("<eos>", "") == row["completion"]
    group_rows = [x for x in rows if x["why"] == "group"]
    assert len({(x["step"], x["group"]) for x in group_rows}) == len(steps)   # one group per step
    for x in group_rows:  # a group's advantages are normalised within it
        same = [y["advantage"] for y in group_rows if (y["step"], y["group"]) == (x["step"], x["group"])]
        assert abs(sum(same)) < 1e-5
    on_disk = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert on_disk == rows
    if preset == "async":   # every trained sample has its mean behaviour weight, in [0, cap]
        trained = [x for x in rows if x["trained"] and x["advantage"]]   # not zero-variance, not surplus
        assert trained and all(x["tis_weight"] is not None for x in trained)
        assert all(0.0 <= x["tis_weight"] <= cfg.async_.behave_imp_cap for x in trained)
        assert all(x["tis_weight"] is None for x in rows if not x["trained"])   # left out: no weight


def test_the_samples_command(tmp_path, capsys):
    sink = JsonlSink(tmp_path)
    base = {"group": 4, "index": 0, "prompt": "[3+4]=", "score": 1.0, "penalty": 0.0, "advantage": 0.5,
            "finish": "stop", "segments": [[0, 2]], "staleness": 0, "tis_weight": None,
            "reward_status": "ok", "reward_error": "", "why": "group", "tokens": ["7", "<eos>"],
            "logprobs": [-0.1, -0.2]}
    sink.samples(1, [{**base, "completion": "short", "reward": 1.0, "length": 2},
                     {**base, "index": 1, "completion": "much longer answer", "reward": 0.0, "length": 9}])
    sink.samples(2, [{**base, "completion": "<script>x</script>", "reward": None, "length": 4,
                      "reward_status": "timeout", "reward_error": "over 10 s", "why": "error"}])
    sink.close()
    assert cli.main(["samples", str(tmp_path), "--step", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("step 1 ") == 2 and "much longer answer" in out and "<script>" not in out
    assert cli.main(["samples", str(tmp_path), "--worst", "-n", "1"]) == 0
    out = capsys.readouterr().out
    assert "reward timeout: over 10 s" in out and "<script>x</script>" in out
    assert cli.main(["samples", str(tmp_path), "--longest", "-n", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["completion"] == "much longer answer"
    assert cli.main(["samples", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["samples", str(tmp_path / "empty")]) == 2
    assert "no samples.jsonl" in capsys.readouterr().err
