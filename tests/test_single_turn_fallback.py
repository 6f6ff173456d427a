"""No silent fallback (trainer/pilot/episodes.py): a run configured for multi-turn episodes whose
episodes are all single-turn for `single_turn_steps` steps in a row says so (advice, an event, the
dashboard's alert), with the reason."""
from __future__ import annotations

import dataclasses

from trainer import config as C
from trainer.observe.metrics import MemorySink
from trainer.pilot import rules
from trainer.pilot.episodes import EVENT, REASON, single_turn_fallback
from trainer.pilot.thresholds import DEFAULT
from trainer.pilot.window import Window
from trainer.run.runner import Runner

N = DEFAULT.single_turn_steps


def rows(turns: list[int], **extra) -> list[dict]:
    return [{"step": i + 1, "episode/turns/max": t, "episode/tool_use_rate": 0.0,
             "reward/accuracy": 0.5, "rollout/truncated_ratio": 0.0, "episode/env_errors": 0,
             **extra} for i, t in enumerate(turns)]


def advise(turns, overrides=(), **extra):
    cfg = C.load("agent", list(overrides))
    return single_turn_fallback(Window(rows(turns, **extra)), cfg, DEFAULT)


def test_n_single_turn_steps_in_a_row_advise_with_the_reason():
    assert N == 5
    a = advise([1] * N)
    assert a is not None and (a.rule, a.reason, a.knob) == ("episodes", REASON, None)
    assert "episode.max_turns is 3" in a.message and f"last {N} steps" in a.message
    assert "the model never called a tool (calculator) and feedback is off" in a.message
    assert advise([1] * (N - 1)) is None              # not yet a pattern
    assert advise([1, 1, 2] + [1] * (N - 1)) is None   # a two-turn step breaks the streak
    assert advise([2] + [1] * N) is not None
    assert advise([1] * N, ["episode.max_turns=1"]) is None   # single-turn by choice
    # the rule is one of the pilot's: the runner announces it with the others
    assert any(a.reason == REASON for a in rules.advise(rows([1] * N), C.load("agent")))


def test_the_reason_names_what_the_metrics_and_config_show():
    assert "token budget in its first turn" in advise([1] * N, **{"rollout/truncated_ratio": 1.0}).message
    env = ["episode.environment=fakes.guess_env:GuessEnv"]
    assert "returned done() after every first turn" in advise([1] * N, env).message
    assert "failed episodes in every step" in advise([1] * N, env, **{"episode/env_errors": 2}).message
    assert "nothing answers a turn" in advise([1] * N, ["episode.tools="]).message
    right = advise([1] * N, ["episode.feedback=true"], **{"reward/accuracy": 1.0})
    assert "every first answer was right" in right.message
    called = advise([1] * N, **{"episode/tool_use_rate": 0.5})
    assert "ended every episode after its first turn" in called.message
    later = dataclasses.replace(DEFAULT, single_turn_steps=N + 2)
    assert single_turn_fallback(Window(rows([1] * N)), C.load("agent"), later) is None


def test_a_multi_turn_run_whose_model_never_calls_a_tool_says_so(tmp_path):
    # the demo model never learnt the calculator: offered it, it answers at once, every time
    cfg = C.load("demo", ["episode.max_turns=3", "episode.tools=calculator", "data.max_list_len=3",
                          "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
                          "rollout.max_response_len=32", "rollout.max_slots=8", "run.eval_every=0",
                          "run.checkpoint_every=0", "run.reward_workers=0", "model.threads=1",
                          f"run.max_steps={N}"])
    sink = MemorySink()
    with Runner(cfg, tmp_path, sink=sink, system_telemetry=False) as runner:
        runner.run()
    assert all(r["episode/turns/max"] == 1 for r in sink.steps if "episode/turns/max" in r)
    events = [e for e in sink.events if e["kind"] == EVENT]
    assert len(events) == 1 and events[0]["step"] == N
    assert "never called a tool" in events[0]["message"]
    advice = [e for e in sink.events if e["kind"] == "advice" and e["reason"] == REASON]
    assert len(advice) == 1 and advice[0]["message"] == events[0]["message"]
