"""reasoning-gym's verifier: the answer in a completion and the dataset's own score of it. The
names and options are parsed with the config (trainer/config/reasoning_gym.py, re-exported here);
trainer/tasks/reasoning_gym.py is the task."""
from __future__ import annotations

from trainer.config.reasoning_gym import (  # noqa: F401 -- the task's names, from one place
    PREFIX,
    check_task,
    dataset_name,
    dataset_names,
    load_dataset,
    parse_options,
)

KIND = "reasoning_gym"          # the registry's name of the verifier (Problem.kind)
SEED_STRIDE = 10_000_000        # data.train_size's largest value: runs' seeds never share rows


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
