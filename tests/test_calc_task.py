"""The calculator task (trainer/tasks/calc.py): sum a list, by hand or with a calculator tool."""
from trainer import config as C
from trainer.tasks import TASKS, build_task
from trainer.tasks.calc import CalcTask, calc_call, calc_result
from trainer.tasks.sum import format_prompt, reference_solution, score_sum


def _values(prompt: str) -> list[int]:
    return [int(x) for x in prompt[1:-2].split(",")]


def test_problems_are_deterministic_lists_of_bounded_length_and_operands():
    task = CalcTask(max_len=6, max_operand=99, seed=5)
    again = CalcTask(max_len=6, max_operand=99, seed=5)
    problems = [task.train_problem(i) for i in range(300)]
    assert problems == [again.train_problem(i) for i in range(300)]
    assert problems != [CalcTask(seed=6).train_problem(i) for i in range(300)]
    lengths = set()
    for p in problems:
        values = _values(p.prompt)
        lengths.add(len(values))
        assert p.prompt == format_prompt(values) and p.answer == sum(values)
        assert all(1 <= v <= 99 for v in values)
    assert lengths == {2, 3, 4, 5, 6}   # uniform over [2, max_len]: every length is common


def test_problems_are_scored_as_sums_by_hand_or_after_a_tool_call():
    task = CalcTask(seed=1)
    p = task.problem(7)
    assert p.kind == "sum" and p.id == "calc:0:7"
    values = _values(p.prompt)
    assert score_sum(p.answer, reference_solution(values)) == 1.0
    final_turn = f">{p.answer}"  # after calc_call(values) and the environment's calc_result
    assert score_sum(p.answer, final_turn) == 1.0 and score_sum(p.answer, f">{p.answer + 1}") == 0.0
    assert calc_call([23, 58, 91]) == "<calc>23+58+91</calc>"
    assert calc_result(172) == "<result>172</result>"


def test_eval_problems_are_held_out_and_stable():
    task = CalcTask(train_size=64, seed=2)
    train = {task.train_problem(i).id for i in range(64)}
    evals = task.eval_problems(50)
    assert evals == task.eval_problems(50)
    assert not {p.id for p in evals} & train
    assert {p.prompt for p in evals} != {task.problem(i).prompt for i in range(50)}


def test_widest_prompt_bounds_every_prompt():
    task = CalcTask(max_len=6, max_operand=99)
    widest = task.widest_prompt(None)
    assert widest == "[99,99,99,99,99,99]="
    assert max(len(task.train_problem(i).prompt) for i in range(500)) <= len(widest)


def test_registered_as_calc_with_the_sum_verifier_and_built_from_the_data_section():
    assert TASKS["calc"].score is score_sum
    cfg = C.load("demo", ["data.task=calc", "data.max_list_len=4", "data.max_operand=50"])
    task = build_task(cfg)
    assert isinstance(task, CalcTask) and (task.max_len, task.max_operand) == (4, 50)
    assert all(len(_values(task.problem(i).prompt)) <= 4 for i in range(100))
