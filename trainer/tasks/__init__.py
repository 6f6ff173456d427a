"""Verifiable tasks: where prompts come from and how a completion is scored."""
from trainer.tasks.base import Problem, Task, build_task

__all__ = ["Problem", "Task", "build_task"]
