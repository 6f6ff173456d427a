"""Verifiable tasks, and the one registry of them: name -> (factory, verifier, preload).

`data.task` names a task; `build_task` builds it from the config, and the reward code
(trainer/rewards/dispatch.py) scores a problem with the verifier registered under its
`Problem.kind`. A task's problems carry the name of the task whose verifier scores them: its own,
or another's that checks answers the same way (arith's problems are "math" problems).

The registry imports the task modules and the verifiers, never the reward pool, and no task
module imports it, so there is no import cycle between trainer.tasks and trainer.rewards.
How a problem becomes a prompt (template, system prompt, chat template) is prompts.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from trainer.config import ConfigError
from trainer.rewards.verifiers import Verdict, check_code, score_code, score_math, warm_math
from trainer.tasks import reasoning_gym_catalog as rg
from trainer.tasks.arith import ArithTask
from trainer.tasks.base import Problem, Task
from trainer.tasks.calc import CalcTask
from trainer.tasks.drift import DriftTask
from trainer.tasks.jsonl import JsonlTask
from trainer.tasks.prompts import PromptRenderer
from trainer.tasks.reasoning_gym import ReasoningGymTask
from trainer.tasks.reasoning_gym_catalog import dataset_name, score_reasoning_gym
from trainer.tasks.sum import SumTask, score_sum


@dataclass(frozen=True)
class TaskSpec:
    """One registered task. The verifiers are module-level functions, so they pickle to the
    reward workers; a verifier that runs the completion (code) also has `check_within`, which
    the pool gives the item's time left and whose timeouts it counts as such."""
    build: Callable[[Any, PromptRenderer], Task]        # (config, prompt renderer) -> the task
    score: Callable[[Any, str], float]                  # (answer, completion) -> reward
    preload: Callable[[], None] | None = None           # warms a reward worker's imports
    check_within: Callable[[Any, str, float], Verdict] | None = None


def _sum(cfg, renderer: PromptRenderer) -> Task:
    d = cfg.data
    return SumTask(max_len=d.max_list_len, alpha=d.length_alpha, max_operand=d.max_operand,
                   train_size=d.train_size, seed=cfg.run.seed, renderer=renderer)


def _arith(cfg, renderer: PromptRenderer) -> Task:
    return ArithTask(max_operand=cfg.data.max_operand, train_size=cfg.data.train_size,
                     seed=cfg.run.seed, renderer=renderer)


def _calc(cfg, renderer: PromptRenderer) -> Task:
    d = cfg.data
    return CalcTask(max_len=d.max_list_len, max_operand=d.max_operand, train_size=d.train_size,
                    seed=cfg.run.seed, renderer=renderer)


def _drift(cfg, renderer: PromptRenderer) -> Task:
    d = cfg.data
    return DriftTask(drift_step=d.drift_step, max_operand=d.max_operand, train_size=d.train_size,
                     seed=cfg.run.seed, renderer=renderer)


def _jsonl(cfg, renderer: PromptRenderer) -> Task:
    d = cfg.data
    return JsonlTask(d.path, kind=d.task, template=d.prompt_template, eval_path=d.eval_path,
                     seed=cfg.run.seed, renderer=renderer)


def _reasoning_gym(cfg, renderer: PromptRenderer) -> Task:
    d = cfg.data
    try:
        return ReasoningGymTask(dataset_name(d.task), options=d.task_options,
                                train_size=d.train_size, seed=cfg.run.seed, renderer=renderer)
    except ValueError as e:   # an unknown dataset, or options its config refuses
        raise ConfigError({"data.task": str(e)}) from None


TASKS: dict[str, TaskSpec] = {
    "sum": TaskSpec(_sum, score_sum),
    "arith": TaskSpec(_arith, score_math, preload=warm_math),
    "math": TaskSpec(_jsonl, score_math, preload=warm_math),
    "code": TaskSpec(_jsonl, score_code, check_within=check_code),
    "calc": TaskSpec(_calc, score_sum),   # sum a list with a calculator tool (multi-turn episodes)
    "drift": TaskSpec(_drift, score_sum),  # list sums that get easier at data.drift_step (GRESO)
    # data.task = "reasoning_gym:NAME": a reasoning-gym dataset, scored by its own score_answer
    rg.KIND: TaskSpec(_reasoning_gym, score_reasoning_gym, preload=rg.warm_reasoning_gym),
}


def task_spec(name: str) -> TaskSpec:
    """The registered task `name` (ValueError naming the known ones when there is none)."""
    if isinstance(name, str) and name.startswith(rg.PREFIX):
        name = rg.KIND
    spec = TASKS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"unknown task {name!r}; the known tasks are " + ", ".join(TASKS))
    return spec


def build_task(cfg, tokenizer=None) -> Task:
    """Build the task named by a Config's data section. Prompts are rendered for `tokenizer`
    (its chat template, see trainer/tasks/prompts.py); without one they are plain text."""
    try:
        spec = task_spec(cfg.data.task)
    except ValueError as e:
        raise ConfigError({"data.task": str(e)}) from None
    return spec.build(cfg, PromptRenderer.from_config(cfg, tokenizer))


__all__ = ["TASKS", "Problem", "Task", "TaskSpec", "build_task", "task_spec"]
