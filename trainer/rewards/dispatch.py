"""One item's reward: the verifier its problem's kind names in the task registry, never raising.

`score(kind, answer, completion) -> float` is the plain entry point (tests, benchmarks).
`score_item` is what the reward pool runs for each item, in a worker or in-process: it turns an
exception into an "error" and a verifier's own timeout into a "timeout", so that a bad reward
scores 0 and is counted instead of stopping the run. `reward_fn` ('module:function') replaces
the registry's verifiers for every item.
"""
from __future__ import annotations

import importlib
import math
from typing import Any, Callable, Iterable

from trainer.tasks import TASKS, task_spec

_MIN_RUN_S = 0.05   # a time-limited verifier given less than this is not started


def score(kind: str, answer: Any, completion: str) -> float:
    """The reward of `completion` for a problem of `kind` whose answer is `answer`."""
    return task_spec(kind).score(answer, completion)


def is_known(kind: str) -> bool:
    return kind in TASKS


def runs_code(kind: str) -> bool:
    """Whether the kind's verifier runs the completion in a subprocess with its own time limit."""
    spec = TASKS.get(kind)
    return spec is not None and spec.check_within is not None


def preload(kinds: Iterable[str]) -> None:
    """Import what the verifiers of `kinds` need, so that a worker's first batch is not slow."""
    for kind in kinds:
        spec = TASKS.get(kind)
        if spec is not None and spec.preload is not None:
            try:
                spec.preload()
            except Exception:  # noqa: BLE001 -- the first real item reports the problem
                pass


def resolve_reward_fn(spec: str) -> Callable[[str, Any, str], float]:
    """'package.module:function' -> the function (ValueError naming what is wrong)."""
    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name:
        raise ValueError(f"reward function {spec!r}: expected 'module:function'")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except ImportError as e:
        raise ValueError(f"reward function {spec!r}: cannot import {mod_name!r}: {e}") from None
    except AttributeError:
        raise ValueError(f"reward function {spec!r}: {mod_name!r} has no {fn_name!r}") from None
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is not callable")
    return fn


def score_item(kind: str, answer: Any, completion: str, time_left_s: float,
               fn: Callable[[str, Any, str], float] | None = None) -> tuple[float, str, str]:
    """(score, status, note); status is "ok", "error" or "timeout". Never raises.

    A verifier that runs code gets `time_left_s`; `fn(kind, answer, completion)` replaces the
    registry's verifier when given."""
    try:
        if fn is not None:
            return _finite(fn(kind, answer, completion)), "ok", ""
        spec = task_spec(kind)
        if spec.check_within is None:
            return _finite(spec.score(answer, completion)), "ok", ""
        if time_left_s <= _MIN_RUN_S:
            return 0.0, "timeout", "no time left in the batch"
        verdict = spec.check_within(answer, completion, time_left_s)
        return _finite(verdict.score), verdict.status, verdict.detail
    except Exception as e:  # noqa: BLE001 -- a reward must never take the trainer down
        text = f"{type(e).__name__}: {e}"
        return 0.0, "error", text[:300]


def _finite(value: Any) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"the reward is {value}")
    return value
