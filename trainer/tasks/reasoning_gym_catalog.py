"""reasoning-gym's catalogue: task names, options, the datasets, and the verifier. It imports
nothing of the trainer, so the config checks (trainer/config/checks.py) can refuse an unknown name
at load time without importing the task registry; trainer/tasks/reasoning_gym.py is the task."""
from __future__ import annotations

import functools
import json
from typing import Any

PREFIX = "reasoning_gym:"
KIND = "reasoning_gym"          # the registry's name of the verifier (Problem.kind)
SEED_STRIDE = 10_000_000        # data.train_size's largest value: runs' seeds never share rows
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


def extract_answer(completion: str) -> str:
    """The text of the last `<answer>...</answer>` of `completion`, else the completion; stripped."""
    start = completion.rfind("<answer>")
    if start >= 0:
        end = completion.find("</answer>", start)
        if end >= 0:
            return completion[start + len("<answer>"):end].strip()
    return completion.strip()


def score_reasoning_gym(answer: dict, completion: str) -> float:
    """The dataset's own `score_answer` of the completion's answer (see the module docstring)."""
    dataset = load_dataset(answer["dataset"], answer["options"], 0, 1)
    return float(dataset.score_answer(extract_answer(completion), answer["entry"]))


def warm_reasoning_gym() -> None:
    import reasoning_gym  # noqa: F401 -- a reward worker's first batch is then not slow
