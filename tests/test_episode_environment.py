"""Your own environment (`episode.environment`, trainer/episode/interface.py): the toy
number-guessing game of tests/fakes/guess_env.py driven through synchronous, APRIL and
asynchronous runs; its failures kept in their episodes; bad paths and classes refused by name."""
from __future__ import annotations

import pytest
from fakes.guess_env import GUESS_CREDIT, LATE_CREDIT, FailingEnv, GuessEnv, last_guess

from trainer import config as C
from trainer.engine.base import STOP
from trainer.episode.engine import Episodes, new_episode
from trainer.episode.interface import UserEnvironment, launch_problems, load_environment
from trainer.episode.turns import TurnFormat
from trainer.observe.metrics import MemorySink
from trainer.run.runner import Runner
from trainer.tasks.base import Problem

GUESS = ["episode.environment=fakes.guess_env:GuessEnv", "episode.max_turns=3", "episode.tools=",
         "data.max_list_len=3", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
         "rollout.max_response_len=48", "rollout.max_slots=16", "run.eval_every=0",
         "run.checkpoint_every=0", "run.reward_workers=0", "model.threads=1"]
MODES = {"sync": [], "april": ["april.enabled=true", "april.segment_max_tokens=8"],
         "async": ["async.enabled=true", "async.max_staleness=1"], "greso": ["greso.enabled=true"],
         "pool": ["cluster.gen_procs=2"]}   # generation processes: the environment stays here


def run(tmp_path, overrides, steps=3):
    cfg = C.load("demo", [*GUESS, *overrides, f"run.max_steps={steps}"])
    sink = MemorySink()
    with Runner(cfg, tmp_path, sink=sink, system_telemetry=False) as runner:
        runner.run()
    return runner, [r for r in sink.steps if "reward/mean" in r]


@pytest.mark.parametrize("mode", list(MODES))
def test_a_user_environment_drives_multi_turn_episodes_and_scores_them(tmp_path, mode):
    runner, rows = run(tmp_path, MODES[mode])
    assert runner.step == 3 and rows
    assert max(r["episode/turns/max"] for r in rows) > 1          # "higher"/"lower" and another try
    assert sum(r["episode/env_tokens"] for r in rows) > 0
    # the environment's reward: a wrong guess earns GUESS_CREDIT, which the sum verifier never
    # gives (it scores only right answers, and only those count in the accuracy)
    assert any(r["reward/mean"] > r["reward/accuracy"] for r in rows)
    assert all(r["episode/env_errors"] == 0 and r["reward/errors"] == 0 for r in rows)


def test_an_environment_that_raises_fails_its_episodes_and_the_run_goes_on(tmp_path):
    runner, rows = run(tmp_path, ["episode.environment=fakes.guess_env:FailingEnv"])
    assert runner.step == 3
    failed = sum(r["episode/env_errors"] for r in rows)
    assert failed > 0 and sum(r["reward/errors"] for r in rows) == failed


# --- the wrapper, turn by turn --------------------------------------------------------------------

class OneEngine:
    """Writes the next of `turns` (then EOS) each time a sample is submitted."""

    def __init__(self, tok, turns):
        self.tok, self.turns, self.running = tok, list(turns), []

    def submit(self, samples):
        self.running += samples

    @property
    def num_pending(self):
        return len(self.running)

    def step(self):
        out, self.running = self.running, []
        for s in out:
            k = s.meta["turns_written"] = s.meta.get("turns_written", -1) + 1
            ids = self.tok(self.turns[k], add_special_tokens=False).input_ids + [self.tok.eos_token_id]
            s.response_ids += ids
            s.logprobs += [-0.5] * len(ids)
            s.versions += [0] * len(ids)
            s.finish_reason = STOP
        return out

    def abort(self, request_ids=None, keep_cache=False):
        return []

    def close(self):
        pass


def play(env, turns, answer=7, max_turns=4):
    from trainer.engine.base import Sample, SamplingParams
    from trainer.models.loading import build_char_tokenizer

    tok = build_char_tokenizer()
    problem = Problem(id="p", prompt="[3,4]=", answer=answer, kind="sum")
    s = Sample(tok(problem.prompt).input_ids, SamplingParams(max_new_tokens=200))
    s.meta["episode"] = new_episode(problem, ())
    engine = Episodes(OneEngine(tok, turns), tok, env, TurnFormat(tok, chat=False),
                      max_turns=max_turns)
    (out,) = engine.generate([s])
    return tok.decode(out.response_ids, skip_special_tokens=True), out.meta["episode"]


def test_the_game_turn_by_turn_state_feedback_and_score():
    env = UserEnvironment(GuessEnv(), "GuessEnv")
    text, ep = play(env, [">5", ">9", ">7"])
    assert text == ">5<feedback>higher</feedback>>9<feedback>lower</feedback>>7"
    assert ep["turns"] == 3 and ep["end"] == "answer" and ep["feedback"] == 2
    assert ep["state"] == {"secret": 7, "guesses": [5, 9, 7]} and ep["score"] == LATE_CREDIT
    _, ep = play(env, [">7"])
    assert ep["turns"] == 1 and ep["score"] == 1.0
    _, ep = play(env, [">5", ">6"], max_turns=2)   # out of turns: the last guess is not answered
    assert ep["end"] == "max_turns" and ep["score"] == GUESS_CREDIT
    assert ep["state"]["guesses"] == [5]
    assert last_guess("1+2=3;>3") == 3


def test_failures_in_each_method_end_the_episode_naming_class_and_method():
    _, ep = play(UserEnvironment(FailingEnv(), "FailingEnv"), [">5", ">7"], answer=7)
    assert ep["end"] == "error" and "score" not in ep
    assert ep["error"] == "FailingEnv.respond raised RuntimeError: the game server is down"

    class BadStart(GuessEnv):
        def start(self, problem):
            return {"secret": object()}

    _, ep = play(UserEnvironment(BadStart(), "BadStart"), [">5"])
    assert ep["end"] == "error" and ep["error"].startswith("BadStart.start: the episode's state")

    class BadScore(GuessEnv):
        def score(self, turn, episode):
            return float("nan")

    _, ep = play(UserEnvironment(BadScore(), "BadScore"), [">7"])
    assert ep["end"] == "answer" and "BadScore.score returned nan" in ep["error"]

    class BadReply(GuessEnv):
        def respond(self, turn, episode):
            return "higher"

    _, ep = play(UserEnvironment(BadReply(), "BadReply"), [">5"])
    assert "BadReply.respond returned str, not a Reply" in ep["error"]


# --- refused at launch, by name ---------------------------------------------------------------------

@pytest.mark.parametrize("spec, says", [
    ("fakes.guess_env", "expected 'package.module:Class'"),
    ("fakes.no_such_module:GuessEnv", "cannot import 'fakes.no_such_module'"),
    ("fakes.guess_env:Missing", "has no 'Missing'"),
    ("fakes.guess_env:not_a_class", "not_a_class is not a class"),
    ("fakes.guess_env:NoScore", "NoScore does not implement the environment interface: no method 'score'"),
    ("fakes.guess_env:BrokenInit", "BrokenInit.__init__ raised RuntimeError: no game server configured"),
])
def test_bad_environments_are_refused_by_name(spec, says):
    with pytest.raises(ValueError) as e:
        load_environment(spec)
    assert says in str(e.value)
    cfg = C.load("demo", [f"episode.environment={spec}", "episode.max_turns=3"])
    assert says in launch_problems(cfg)["episode.environment"]


def test_an_environment_needs_more_than_one_turn():
    cfg = C.load("demo", ["episode.environment=fakes.guess_env:GuessEnv"])
    assert "episode.max_turns > 1" in launch_problems(cfg)["episode.environment"]
    assert launch_problems(C.load("demo", GUESS)) == {}
    assert launch_problems(C.load("demo")) == {}


def test_the_cli_refuses_a_bad_environment_before_making_a_run_directory(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(root / "tests")}
    p = subprocess.run([sys.executable, "-m", "trainer", "run", "demo", "--set", "episode.max_turns=3",
                        "--set", "episode.environment=fakes.guess_env:NoScore", "--out", str(out)],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "episode.environment" in p.stderr and "NoScore" in p.stderr and "'score'" in p.stderr
    assert not out.exists()
