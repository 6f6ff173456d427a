"""The built-in task's shape and the warm-up that makes the built-in model."""
import torch

from trainer.models.loading import load_model, load_tokenizer
from trainer.run.warmup import warmup
from trainer.tasks.sum import SumTask, reference_solution, score_sum


def test_reference_solutions_score_one_and_wrong_answers_zero():
    task = SumTask(seed=3)
    for i in range(50):
        p = task.train_problem(i)
        values = [int(x) for x in p.prompt[1:-2].split(",")]
        assert score_sum(p.answer, reference_solution(values)) == 1.0
        assert score_sum(p.answer, reference_solution(values) + "1") == 0.0
    assert score_sum(5, "2+3=5;") == 0.0  # no final answer


def test_lengths_are_heavy_tailed():
    task = SumTask(seed=0)
    lengths = sorted(len(reference_solution([int(x) for x in task.train_problem(i).prompt[1:-2]
                                             .split(",")])) for i in range(4000))
    total = sum(lengths)
    top10 = sum(lengths[int(0.9 * len(lengths)):])
    assert lengths[len(lengths) // 2] < 20 and lengths[-1] > 150
    assert top10 / total > 0.4  # the longest 10% hold a large share of the tokens


def test_training_problems_recur_in_shuffled_epochs():
    task = SumTask(train_size=16, seed=1)
    first = [task.train_problem(i).id for i in range(16)]
    second = [task.train_problem(i).id for i in range(16, 32)]
    assert sorted(first) == sorted(second) and first != second
    assert task.eval_problems(5) == task.eval_problems(5)
    assert not {p.id for p in task.eval_problems(50)} & set(first)


def test_warmup_saves_a_loadable_model(tmp_path):
    info = warmup(tmp_path, steps=3, log=lambda *a: None)
    assert info["steps"] == 3
    model = load_model(str(tmp_path), torch.device("cpu"), torch.float32)
    tok = load_tokenizer(str(tmp_path))
    assert model.config.model_type == "qwen2"
    assert tok.decode(tok("[1,2]=1+2=3;>3").input_ids) == "[1,2]=1+2=3;>3"


def test_shipped_builtin_model_is_partly_competent():
    model = load_model("builtin", torch.device("cpu"), torch.float32)
    assert 5e5 < sum(p.numel() for p in model.parameters()) < 2e6
