"""The parser of `data.task = "reasoning_gym:NAME"` and `data.task_options`: reasoning-gym's
dataset names, their options, the datasets themselves. Here, with the schema, so that the config
checks (trainer/config/checks.py) refuse an unknown name at load time without importing the task
registry; trainer/tasks/reasoning_gym.py is the task, trainer/tasks/reasoning_gym_catalog.py its
verifier."""
from __future__ import annotations

import functools
import json
from typing import Any

PREFIX = "reasoning_gym:"
_EXAMPLES = ("basic_arithmetic", "chain_sum", "letter_counting", "leg_counting", "gcd")


def dataset_name(task: str) -> str:
    """'reasoning_gym:NAME' -> NAME (ValueError when `task` is not one)."""
    if not isinstance(task, str) or not task.startswith(PREFIX) or not task[len(PREFIX):]:
        raise ValueError(f"expected 'reasoning_gym:NAME', got {task!r}")
    return task[len(PREFIX):]


def dataset_names() -> list[str]:
    """Every dataset reasoning-gym registers (imports it)."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def parse_options(text: str) -> dict[str, Any]:
    """`data.task_options` (a JSON object, "" = none) as a dict; ValueError saying what is wrong."""
    if not (text or "").strip():
        return {}
    try:
        out = json.loads(text)
    except (ValueError, RecursionError):
        raise ValueError('not valid JSON: expected an object, e.g. {"max_terms": 2}') from None
    if not isinstance(out, dict):
        raise ValueError('expected a JSON object, e.g. {"max_terms": 2}')
    for key in ("seed", "size"):
        if key in out:
            raise ValueError(f"{key!r} is set by the run (run.seed, data.train_size), not here")
    return out


def check_task(task: str, options: str = "") -> None:
    """Refuse an unknown dataset (naming a few known ones) or options its config does not take."""
    name = dataset_name(task)
    names = dataset_names()
    if name not in names:
        few = [n for n in _EXAMPLES if n in names]
        raise ValueError(f"unknown reasoning-gym task {name!r}; e.g. "
                         + ", ".join(f"reasoning_gym:{n}" for n in few)
                         + f" ({len(names)} in all: python -c \"import reasoning_gym.factory as f; "
                         "print(sorted(f.DATASETS))\")")
    load_dataset(name, json.dumps(parse_options(options), sort_keys=True), 0, 1)


@functools.lru_cache(maxsize=16)
def load_dataset(name: str, options: str, seed: int, size: int):
    """The dataset `name` with `options` (JSON, as keyed in the cache); ValueError naming a bad
    option."""
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise ValueError(f"unknown reasoning-gym task {name!r}")
    dataset_cls, config_cls = DATASETS[name]
    kwargs = json.loads(options)
    try:
        config = config_cls(**kwargs, seed=seed, size=size)
        if hasattr(config, "validate"):
            config.validate()
    except TypeError as e:
        raise ValueError(f"reasoning_gym:{name} does not take these options: {e}") from None
    except AssertionError as e:
        raise ValueError(f"reasoning_gym:{name}: {e}") from None
    return dataset_cls(config=config)
