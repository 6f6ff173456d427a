"""The task registry (trainer/tasks/__init__.py): one table, name -> (factory, verifier, preload),
that the task builder and the reward code both read."""
import dataclasses
import json

import pytest

from trainer import config as C
from trainer.config import ConfigError
from trainer.rewards import dispatch
from trainer.rewards.pool import RewardService
from trainer.rewards.verifiers import Verdict, check_code, score_code, score_math
from trainer.tasks import TASKS, Problem, TaskSpec, build_task, task_spec
from trainer.tasks.sum import score_sum

ADD = {"tests": "assert add(1, 2) == 3", "entry_point": "add"}


def test_the_registry_names_exactly_the_tasks_the_config_allows():
    spec = C.param_spec("data.task")
    assert set(spec.choices) == {"sum", "arith", "math", "code", "calc", "drift"}
    # and reasoning-gym's datasets, named "reasoning_gym:NAME", under one verifier
    assert spec.prefixes == ("reasoning_gym:",)
    assert set(TASKS) == set(spec.choices) | {"reasoning_gym"}
    assert task_spec("reasoning_gym:basic_arithmetic") is TASKS["reasoning_gym"]


def _config(name, tmp_path):
    rows = {"math": [{"prompt": "What is 6 * 7?", "answer": 42}],
            "code": [{"prompt": "Write add(a, b).", **ADD}]}
    extra = []
    if name in rows:
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows[name]))
        extra = [f"data.path={path}"]
    if name == "reasoning_gym":
        name = "reasoning_gym:basic_arithmetic"
    return C.load("demo", [f"data.task={name}", *extra])


RIGHT = {"sum": lambda a: f">{a}", "calc": lambda a: f">{a}", "drift": lambda a: f">{a}",
         "arith": lambda a: f"so \\boxed{{{a}}}", "math": lambda a: f"\\boxed{{{a}}}",
         "code": lambda a: "def add(a, b):\n    return a + b",
         "reasoning_gym": lambda a: f"<answer>{a['entry']['answer']}</answer>"}
WRONG = {"sum": lambda a: f">{a + 1}", "calc": lambda a: f">{a + 1}",
         "drift": lambda a: f">{a + 1}", "arith": lambda a: f"\\boxed{{{int(a) + 1}}}",
         "math": lambda a: "\\boxed{41}", "code": lambda a: "def add(a, b):\n    return a - b",
         "reasoning_gym": lambda a: "<answer>x</answer>"}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_each_task_builds_from_the_config_and_its_problems_reach_its_own_verifier(name, tmp_path):
    task = build_task(_config(name, tmp_path))
    p = task.problem(0)
    assert task_spec(p.kind).score is TASKS[name].score   # arith's "math" problems: the same check
    assert dispatch.score(p.kind, p.answer, RIGHT[name](p.answer)) == 1.0
    assert dispatch.score(p.kind, p.answer, WRONG[name](p.answer)) == 0.0


def test_the_verifiers_are_the_ones_each_task_needs():
    assert [TASKS[n].score for n in ("sum", "arith", "math", "code")] == [
        score_sum, score_math, score_math, score_code]
    assert TASKS["code"].check_within is check_code
    assert [n for n, s in TASKS.items() if s.check_within] == ["code"]
    assert {n for n, s in TASKS.items() if s.preload} == {"arith", "math", "reasoning_gym"}


def test_an_unknown_task_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError,
                       match="unknown task 'poetry'; the known tasks are sum, arith, math, code, calc, drift"):
        task_spec("poetry")
    cfg = C.load("demo")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, task="poetry"))  # past check()
    with pytest.raises(ConfigError) as e:
        build_task(cfg)
    assert "unknown task 'poetry'" in e.value.errors["data.task"] and "arith" in e.value.errors["data.task"]


# --- the reward code reads the registry --------------------------------------------------------------

@pytest.fixture
def echo_task(monkeypatch):
    """Registers "echo" (reward 1 when the completion is the answer) and "slow" (a time-limited
    verifier that records the time it was given and reports a timeout)."""
    given = []

    def slow(answer, completion, seconds):
        given.append(seconds)
        return Verdict(0.0, "timeout", f"ran out after {seconds:.1f}s")

    monkeypatch.setitem(TASKS, "echo", TaskSpec(TASKS["sum"].build, lambda a, c: float(a == c)))
    monkeypatch.setitem(TASKS, "slow", TaskSpec(TASKS["sum"].build, lambda a, c: 1.0, check_within=slow))
    return given


def test_the_pool_scores_a_kind_with_the_verifier_registered_for_it(echo_task):
    probs = [Problem("a", "p", "yes", "echo"), Problem("b", "p", "yes", "echo"),
             Problem("c", "p", 3, "slow")]
    with RewardService(workers=0, timeout_s=30, item_timeout_s=2.0) as svc:
        b = svc.score_batch(probs, ["yes", "no", "x"])
    assert b.scores == [1.0, 0.0, 0.0]
    assert b.statuses == ["ok", "ok", "timeout"] and b.timeouts == 1
    assert b.notes[2] == "ran out after 2.0s"
    assert echo_task == [pytest.approx(2.0, abs=0.1)]   # the item limit: the batch had 30 s left


def test_a_time_limited_verifier_is_not_started_without_time_left(echo_task):
    assert dispatch.score_item("slow", 3, "x", 0.01) == (0.0, "timeout", "no time left in the batch")
    assert echo_task == []
    assert dispatch.score_item("echo", "yes", "yes", 0.01) == (1.0, "ok", "")   # untimed: scored


def test_only_kinds_whose_verifier_runs_code_are_handed_out_one_at_a_time(echo_task):
    assert dispatch.runs_code("code") and dispatch.runs_code("slow")
    assert not dispatch.runs_code("sum") and not dispatch.runs_code("math")
    assert not dispatch.runs_code("poetry")   # scored later as an error, never a crash here


def test_preload_runs_the_registered_warm_ups_and_survives_one_that_fails(monkeypatch):
    called = []

    def broken():
        called.append("broken")
        raise RuntimeError("no sympy today")

    monkeypatch.setitem(TASKS, "math", dataclasses.replace(TASKS["math"], preload=lambda: called.append("math")))
    monkeypatch.setitem(TASKS, "arith", dataclasses.replace(TASKS["arith"], preload=broken))
    dispatch.preload(["arith", "sum", "poetry", "math"])
    assert called == ["broken", "math"]


def test_an_unregistered_kind_scores_zero_as_an_error_naming_the_known_tasks():
    score, status, note = dispatch.score_item("poetry", "1", "1", 5.0)
    assert (score, status) == (0.0, "error")
    assert "unknown task 'poetry'" in note and "sum, arith, math, code" in note
