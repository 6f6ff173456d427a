"""The environment interface, and your own environment: `episode.environment = "pkg.mod:Class"`.

An environment runs one side of every multi-turn episode (docs/episodes.md has a complete
example):

    class MyEnv:
        def start(self, problem) -> dict | None:
            '''A new episode for `problem` (a trainer.tasks.Problem: id, prompt as the model reads
            it, answer, kind): its state, plain JSON-able data (None: none).'''
        def respond(self, turn: str, episode: dict) -> Reply:
            '''The model's turn just ended (`turn`: its text). Answer with feedback(text),
            tool_result(text) or done(). `episode["state"]` is the state, which respond may
            change in place; episode["answer"], ["kind"], ["turns"] are the episode's so far.'''
        def score(self, turn: str, episode: dict) -> float | None:
            '''The finished episode's reward (`turn`: its last model turn); None: the task's
            verifier scores it.'''

The built-in environment (trainer/episode/environments.py: tools, feedback) implements the same
three methods. Everything an episode needs between turns lives in `episode` (checkpointed with
the sample), so the object itself should keep no per-episode state: one instance answers every
episode of a run, from worker threads.

`UserEnvironment` wraps your object so that whatever it does wrong stays in its episode: an
exception in `start`, `respond` or `score`, a reply that is not a `Reply`, a state that is not
JSON-able ends that episode with an error (reward 0, counted as a reward error and in
`episode/env_errors`), naming the class and the method; the run goes on. `load_environment`
refuses, by name, a path that does not import, a class that does not implement the interface, or
one whose construction raises: the command line and the dashboard check it at launch
(`launch_problems`).
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import json
import math
from dataclasses import dataclass
from typing import Any

from trainer.episode.environments import DONE, Reply
from trainer.episode.turns import FEEDBACK, TOOL


@dataclass(frozen=True)
class Problem:
    id: str            # stable across runs: used for GRESO traces and reports
    prompt: str        # the text given to the model, rendered (trainer/tasks/prompts.py)
    answer: Any        # what the verifier needs (an int, a LaTeX string, tests...)
    kind: str          # the registered task whose verifier scores it: "sum", "math" or "code"
    tools: tuple[str, ...] | None = None   # its own tools in an episode (None: `episode.tools`)


# A task's row (trainer/tasks/ hands them out) is what an environment starts an episode from:
# declared here, below the tasks, so the episode wrapper builds one without importing them.
METHODS = ("start", "respond", "score")
_MAX_ERROR = 300


def feedback(text: str) -> Reply:
    """A message to the model (the next turn follows it): a hint, the game's answer, a critique."""
    return Reply(FEEDBACK, str(text))


def tool_result(text: str, error: bool = False) -> Reply:
    """A tool's result (the chat template's tool role); `error` counts it as a failed call."""
    return Reply(TOOL, str(text), error=bool(error), tool="environment")


def done() -> Reply:
    """The episode is over: nothing is appended, and it is scored."""
    return DONE


class EnvironmentProblem(ValueError):
    """What `load_environment` refuses, with the message to show."""


def load_environment(spec: str):
    """'package.module:Class' -> an instance (EnvironmentProblem naming what is wrong)."""
    mod_name, sep, cls_name = (spec or "").partition(":")
    if not sep or not mod_name.strip() or not cls_name.strip():
        raise EnvironmentProblem(f"{spec!r}: expected 'package.module:Class'")
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 -- any import failure is the path's problem
        raise EnvironmentProblem(f"{spec!r}: cannot import {mod_name!r}: {_text(e)}") from None
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise EnvironmentProblem(f"{spec!r}: module {mod_name!r} has no {cls_name!r}")
    if not inspect.isclass(cls):
        raise EnvironmentProblem(f"{spec!r}: {cls_name} is not a class")
    missing = [m for m in METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise EnvironmentProblem(
            f"{spec!r}: {cls_name} does not implement the environment interface: no method "
            + ", ".join(repr(m) for m in missing) + " (an environment has start, respond and "
            "score: docs/episodes.md)")
    try:
        return cls()
    except Exception as e:  # noqa: BLE001 -- the user's constructor
        raise EnvironmentProblem(f"{spec!r}: {cls_name}.__init__ raised {_text(e)}") from None


def launch_problems(cfg) -> dict[str, str]:
    """{"episode.environment": why} when the configured environment cannot be used; {} otherwise
    (also when none is configured)."""
    spec = cfg.episode.environment.strip()
    if not spec:
        return {}
    if cfg.episode.max_turns < 2:
        return {"episode.environment": "an environment answers model turns: set "
                                       "episode.max_turns > 1"}
    try:
        load_environment(spec)
    except EnvironmentProblem as e:
        return {"episode.environment": str(e)}
    return {}


class UserEnvironment:
    """A person's environment object behind the engine's environment interface (module
    docstring): its failures become its episodes' errors."""

    def __init__(self, env, name: str):
        self.env, self.name = env, name
        # what the engine sets on the built-in environment (`episode.*` knobs): unused here
        self.feedback, self.timeout_s, self.output_chars = False, 0.0, 0

    def start(self, problem):
        """The episode's state (a JSON-able dict, or None); raises EnvironmentProblem naming the
        class and the method."""
        try:
            state = self.env.start(problem)
        except Exception as e:  # noqa: BLE001 -- the user's code
            raise EnvironmentProblem(self._raised("start", e)) from None
        if state is not None:
            self._check_state(state, "start")
        return state

    def respond(self, turn: str, episode: dict) -> Reply:
        """Never raises: a failure is a reply that ends the episode with the error."""
        mine = dict(episode)
        mine["state"] = copy.deepcopy(episode.get("state"))
        try:
            reply = self.env.respond(turn, mine)
            if not isinstance(reply, Reply):
                raise EnvironmentProblem(f"{self.name}.respond returned {type(reply).__name__}, "
                                        "not a Reply (use feedback(), tool_result() or done())")
            if mine["state"] is not None:
                self._check_state(mine["state"], "respond")
        except EnvironmentProblem as e:
            return Reply(None, failure=str(e)[:_MAX_ERROR])
        except Exception as e:  # noqa: BLE001 -- the user's code
            return Reply(None, failure=self._raised("respond", e))
        return dataclasses.replace(reply, state=mine["state"])

    def score(self, turn: str, episode: dict) -> float | None:
        """The reward (None: the task's verifier); raises EnvironmentProblem naming the method."""
        try:
            value = self.env.score(turn, copy.deepcopy(episode))
        except Exception as e:  # noqa: BLE001 -- the user's code
            raise EnvironmentProblem(self._raised("score", e)) from None
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise EnvironmentProblem(f"{self.name}.score returned {value!r}, not a finite number")
        return float(value)

    def calls_tool(self, turn: str, episode: dict) -> bool:
        """Out of turns, a last turn is not answered: the episode ends at max_turns."""
        return True

    def _check_state(self, state, method: str) -> None:
        try:
            json.dumps(state)
        except (TypeError, ValueError) as e:
            raise EnvironmentProblem(f"{self.name}.{method}: the episode's state must be plain "
                                    f"JSON-able data ({_text(e)})") from None

    def _raised(self, method: str, e: BaseException) -> str:
        return f"{self.name}.{method} raised {_text(e)}"[:_MAX_ERROR]


def episode_verdict(sample) -> tuple[float, str, str] | None:
    """(score, status, note) of a finished episode that its environment scored or that failed;
    None: the task's verifier scores it."""
    ep = sample.episode
    if ep is None:
        return None
    if ep.get("error"):
        return 0.0, "error", str(ep["error"])
    if ep.get("score") is not None:
        return float(ep["score"]), "ok", ""
    return None


def _text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"
