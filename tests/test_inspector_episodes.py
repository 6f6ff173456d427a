"""The rollout inspector's rows for multi-turn episodes (trainer/accounting/inspector.py): an episode's
turns (model runs and environment runs, by version), its counters, a finish and a staleness that
read only the policy's tokens; the episode metrics declared with their charts; the `samples`
command printing an episode turn by turn."""
from __future__ import annotations

import json
from types import SimpleNamespace

from trainer.accounting.inspector import finish, rows, segments, turns
from trainer.cli import main as cli
from trainer.engine.base import ENV_VERSION, LENGTH, STOP, Sample
from trainer.observe import metric_names
from trainer.observe.metrics import JsonlSink
from trainer.rollout.base import Group, episode_metrics
from trainer.tasks.base import Problem

E = ENV_VERSION


class CharTokenizer:
    """Token id = character code (enough for rows(): decode and batch_decode)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)

    def batch_decode(self, batch):
        return [self.decode(ids) for ids in batch]


def episode_sample(text_turns: list[tuple[str, int]], finish_reason=STOP, **counters) -> Sample:
    """A response built turn by turn: (text, version), version ENV_VERSION for the environment's."""
    ids, logprobs, versions = [], [], []
    for text, v in text_turns:
        ids += [ord(c) for c in text]
        logprobs += [0.0 if v == E else -0.5] * len(text)
        versions += [v] * len(text)
    ep = {"kind": "calc", "answer": "81", "tools": ["calculator"], "turns": 2, "tool_calls": 1,
          "tool_errors": 0, "tool_s": 0.002, "feedback": 0, "end": "answer", **counters}
    return Sample([1, 2], response_ids=ids, logprobs=logprobs, versions=versions,
                  finish_reason=finish_reason, meta={"episode": ep})


CALC = [("<calc>23+58</calc>", 3), ("<result>81</result>", E), (">81", 3)]


def test_turns_are_runs_of_model_and_environment_tokens():
    assert turns([3, 3, E, E, E, 3, 4, E, 4]) == [
        {"role": "model", "start": 0, "end": 2, "trained": True},
        {"role": "tool", "start": 2, "end": 5, "trained": False},
        {"role": "model", "start": 5, "end": 7, "trained": True},    # two versions, one turn
        {"role": "tool", "start": 7, "end": 8, "trained": False},
        {"role": "model", "start": 8, "end": 9, "trained": True}]
    assert turns([]) == []
    assert turns([0, 0]) == [{"role": "model", "start": 0, "end": 2, "trained": True}]


def test_an_episode_is_not_partial_and_its_staleness_ignores_the_environment():
    s = episode_sample(CALC)
    assert segments(s.versions) == [[3, 18], [E, 19], [3, 3]]   # the environment's run is kept
    assert finish(s) == "stop"                                   # not "partial": -1 is no policy
    assert s.age(4) == 1                                  # not 4 - (-1) = 5
    s.finish_reason = LENGTH
    assert finish(s) == "length"
    parked = episode_sample([("<calc>1+2</calc>", 3), ("<result>3</result>", E), (">3", 4)])
    assert finish(parked) == "partial" and parked.age(4) == 1
    only_env = Sample([1], response_ids=[5], logprobs=[0.0], versions=[E], finish_reason=STOP)
    assert only_env.age(7) == 0


def test_an_episode_row_carries_its_turns_and_counters_and_a_single_turn_row_does_not():
    ep = episode_sample(CALC, turns=2, tool_calls=1, tool_s=0.004)
    single = Sample([1, 2], response_ids=[ord(c) for c in "81"], logprobs=[-0.1, -0.2], versions=[3, 3],
                    finish_reason=STOP)
    g = Group(problem=Problem(id="p0", prompt="[23,58]=", answer="81", kind="calc"), samples=[ep, single], draw=7)
    g.rewards = g.raw_scores = [1.0, 0.0]
    g.reward_status = ["ok", "ok"]
    cfg = SimpleNamespace(algo=SimpleNamespace(scale_adv_by_std=True))
    row, plain = rows(5, [(g, 0, "group"), (g, 1, "group")], CharTokenizer(), 4, cfg, {id(g)})
    assert row["turns"] == [{"role": "model", "start": 0, "end": 18, "trained": True},
                            {"role": "tool", "start": 18, "end": 37, "trained": False},
                            {"role": "model", "start": 37, "end": 40, "trained": True}]
    assert row["episode"] == {"turns": 2, "tool_calls": 1, "tool_errors": 0, "tool_s": 0.004, "end": "answer"}
    assert [("".join(row["tokens"][t["start"]:t["end"]])) for t in row["turns"]] == [
        "<calc>23+58</calc>", "<result>81</result>", ">81"]
    assert row["finish"] == "stop" and row["staleness"] == 1 and row["length"] == 40
    assert row["logprobs"][18:37] == [0.0] * 19
    assert "turns" not in plain and "episode" not in plain and plain["staleness"] == 1
    json.dumps(row)   # the sinks write it as JSON


def test_the_episode_metrics_are_declared_and_charted():
    s = episode_sample(CALC)
    reported = set(episode_metrics([s])) | {"eval/tool_use_rate", "eval/turns_mean"}
    assert reported and all(metric_names.declared(k) for k in reported), reported
    charts = {c["id"]: c for c in metric_names.CHARTS}
    charted = {k for cid in ("episodes", "tools", "tool-time") for k in charts[cid]["keys"]}
    # your own environment's failures are not charted yet (a trace of zeros stalls the live
    # episode charts' redraw): they reach the page as the run's reward errors and events
    assert reported - {"episode/env_errors"} <= charted, reported - charted
    for c in metric_names.CHARTS:   # a list of right-axis keys names keys of the chart
        if isinstance(c.get("y2"), list):
            assert set(c["y2"]) < set(c["keys"]), c["id"]
    assert metric_names.page_spec()["charts"] is metric_names.CHARTS


def test_the_samples_command_prints_an_episode_turn_by_turn(tmp_path, capsys):
    ep = episode_sample(CALC)
    g = Group(problem=Problem(id="p0", prompt="[23,58]=", answer="81", kind="calc"), samples=[ep], draw=1)
    g.rewards = g.raw_scores = [1.0]
    g.reward_status = ["ok"]
    cfg = SimpleNamespace(algo=SimpleNamespace(scale_adv_by_std=True))
    sink = JsonlSink(tmp_path)
    sink.samples(3, rows(3, [(g, 0, "group")], CharTokenizer(), 3, cfg, {id(g)}))
    sink.close()
    assert cli.main(["samples", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[v3x18 envx19 v3x3]" in out
    assert "episode: 2 turns, 1 tool call (0 failed, 0.002 s), ended: answer" in out
    assert out.index("[model turn 1]") < out.index("<calc>23+58</calc>") < out.index(
        "[tool message (environment, not trained)]") < out.index("<result>81</result>") < out.index(
        "[model turn 2]") < out.index("\n    >81")
