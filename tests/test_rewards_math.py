"""Math rewards: the final answer is extracted and compared with math_verify."""
import threading

import pytest

from trainer.rewards.dispatch import score
from trainer.rewards.verifiers import extract_answer, last_boxed, score_math


@pytest.mark.parametrize("completion", [
    "\\boxed{1/2}",
    "0.5",
    "\\frac12",
    "so the answer is \\boxed{\\frac{1}{2}}.",
    "The probability is $\\frac{1}{2}$.",
    "We get 1/2.",
    "\\boxed{0.5}",
    "\\boxed{x = \\dfrac{1}{2}}",
])
@pytest.mark.parametrize("gold", ["1/2", "0.5", "\\frac{1}{2}", "\\frac12", 0.5])
def test_equivalent_forms_of_one_half_all_score_one(gold, completion):
    assert score("math", gold, completion) == 1.0


@pytest.mark.parametrize("completion", ["\\boxed{1/3}", "0.6", "The answer is $\\frac{2}{3}$.",
                                        "\\boxed{-1/2}", "\\boxed{2}"])
def test_wrong_answer_scores_zero(completion):
    assert score("math", "1/2", completion) == 0.0


@pytest.mark.parametrize("completion", ["", "   ", "I do not know.", "\\boxed{}",
                                        "Let me think step by step"])
def test_no_answer_scores_zero(completion):
    assert score("math", "1/2", completion) == 0.0


@pytest.mark.parametrize("completion", [
    "}}}{{{\\\\frac \\boxed{",
    "\\boxed{\\frac{1}{",
    "$$$$ $ \\[ \\( \\sqrt{",
    "\\boxed{\\begin{matrix} 1 & }",
    "\x00\x01\x02 \\boxed{\x00}",
    "1" * 5000,
    "\\boxed{" * 200,
    "\\boxed{\\frac{\\frac{\\frac{}{}}{}}{}}",
    "🙂 \\boxed{🙂}",
])
def test_garbage_does_not_raise_and_scores_zero(completion):
    assert score("math", "1/2", completion) == 0.0


def test_last_boxed_answer_wins_over_earlier_ones():
    text = "First try: \\boxed{3}. Wait, that is wrong. Final: \\boxed{1/2}"
    assert score("math", "1/2", text) == 1.0
    assert score("math", "3", text) == 0.0


def test_without_a_box_the_last_number_counts():
    assert score("math", "0.5", "There are 7 cases, so p = 0.5") == 1.0
    assert score("math", "7", "There are 7 cases, so p = 0.5") == 0.0


def test_integer_and_numeric_gold_answers():
    assert score("math", 42, "The answer is $42$.") == 1.0
    assert score("math", "1000", "\\boxed{1,000}") == 1.0
    assert score("math", 7, "\\boxed{8}") == 0.0


def test_symbolic_and_textual_answers():
    assert score("math", "x+1", "Hence $1 + x$.") == 1.0
    assert score("math", "\\frac{\\sqrt{2}}{2}", "\\boxed{\\frac{\\sqrt2}{2}}") == 1.0
    assert score("math", "Tuesday", "\\boxed{\\text{Tuesday}}") == 1.0
    assert score("math", "Tuesday", "\\boxed{\\text{Monday}}") == 0.0


def test_last_boxed_handles_nesting_and_unbalanced_boxes():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{3} then \\boxed{\\frac{1}{") == "3"
    assert last_boxed("\\boxed 5") == "5"
    assert last_boxed("no box") is None
    assert extract_answer("7 and then 0.5")[0] == "0.5"


def test_score_math_works_outside_the_main_thread():
    # math_verify's own time limit uses SIGALRM, which only the main thread may set.
    out = []
    t = threading.Thread(target=lambda: out.append(score_math("1/2", "\\boxed{0.5}")))
    t.start()
    t.join(30)
    assert out == [1.0]


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown task 'poetry'; the known tasks are sum, arith, math, code"):
        score("poetry", "1", "1")
    with pytest.raises(TypeError, match="completion must be a string"):
        score_math("1", None)
    with pytest.raises(TypeError, match="math answer"):
        score_math(["1"], "1")


def test_sum_kind_dispatches_to_score_sum():
    assert score("sum", 16, "3+5=8;8+1=9;9+7=16;>16") == 1.0
    assert score("sum", 16, ">15") == 0.0
