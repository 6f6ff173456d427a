"""reasoning-gym's procedural, verifiable tasks as a task source: `data.task = "reasoning_gym:NAME"`.

    data.task = "reasoning_gym:basic_arithmetic"
    data.task_options = '{"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"]}'

Nothing is downloaded: reasoning-gym generates item `idx` of a dataset whose seed is `S` from
`Random(S + idx)`. Training rows are items 0..train_size-1 of the dataset seeded
`run.seed * SEED_STRIDE`; held-out rows are items of the dataset seeded `train_size` further on,
so the two splits are drawn from disjoint generator seeds (a tiny problem space can still repeat a
question in both: disjoint seeds, not necessarily distinct texts).

The reward is the dataset's own scorer, `dataset.score_answer(answer, entry)`, on the text of the
completion's last `<answer>...</answer>` (reasoning-gym's convention), or on the whole completion,
stripped, when it has none. The verifier runs in the reward workers: the problem's answer carries
the dataset's name, its options and the entry, and each worker rebuilds the dataset once.

reasoning-gym is imported only when such a task is used (its import takes about 2 s).
"""
from __future__ import annotations

import functools
import json
from typing import Any

from trainer.tasks.base import Problem, Task
from trainer.tasks.prompts import PromptRenderer

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
    _dataset(name, json.dumps(parse_options(options), sort_keys=True), 0, 1)


@functools.lru_cache(maxsize=16)
def _dataset(name: str, options: str, seed: int, size: int):
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
    dataset = _dataset(answer["dataset"], answer["options"], 0, 1)
    return float(dataset.score_answer(extract_answer(completion), answer["entry"]))


def warm_reasoning_gym() -> None:
    import reasoning_gym  # noqa: F401 -- a reward worker's first batch is then not slow


class ReasoningGymTask(Task):
    """Rows of the reasoning-gym dataset `name`, generated by seed (module docstring)."""

    def __init__(self, name: str, options: str = "", train_size: int = 4096, seed: int = 0,
                 renderer: PromptRenderer | None = None):
        check_task(PREFIX + name, options)
        self.name = PREFIX + name
        self.dataset = name
        self.options = json.dumps(parse_options(options), sort_keys=True)
        self.train_size, self.seed = train_size, seed
        self.train_seed = seed * SEED_STRIDE
        self.eval_seed = self.train_seed + train_size   # held-out: the seeds after the training rows
        self._train = _dataset(name, self.options, self.train_seed, train_size)
        if renderer is not None:
            self.renderer = renderer

    def _problem(self, split: str, dataset, index: int) -> Problem:
        entry = dataset[index]
        return Problem(id=f"{self.name}:{split}:{index}",
                       prompt=self.renderer.render(entry["question"]),
                       answer={"dataset": self.dataset, "options": self.options, "entry": entry},
                       kind=KIND)

    def problem(self, row: int) -> Problem:
        return self._problem("train", self._train, row)

    def eval_problems(self, n: int) -> list[Problem]:
        held_out = _dataset(self.dataset, self.options, self.eval_seed, max(1, n))
        return [self._problem("eval", held_out, i) for i in range(n)]

    def item_seeds(self, split: str, n: int) -> range:
        """The generator seeds (reasoning-gym's `seed + idx`) of the first `n` rows of a split."""
        base = self.train_seed if split == "train" else self.eval_seed
        return range(base, base + n)
