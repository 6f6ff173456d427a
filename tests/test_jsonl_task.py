"""JsonlTask: math and code problems from JSONL files, validated at construction."""
import json

import pytest

from trainer.config import Config, ConfigError
from trainer.tasks import Problem, build_task
from trainer.tasks.jsonl import JsonlTask


def write_jsonl(path, rows):
    """Rows are dicts (dumped as JSON) or raw strings (written as they are)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


MATH = [{"prompt": "What is 1/4 + 1/4?", "answer": "\\frac{1}{2}"},
        {"prompt": "Solve {x | x > 2} ∩ {x | x < 3}.", "answer": "(2,3)", "id": "sets"},
        {"prompt": "What is 6 * 7?", "answer": 42}]
CODE = [{"prompt": "Write add(a, b).", "tests": "assert add(1, 2) == 3", "entry_point": "add"},
        {"prompt": "Write neg(x).", "tests": ["assert neg(1) == -1", "assert neg(0) == 0"],
         "entry_point": "neg"}]


@pytest.fixture
def math_file(tmp_path):
    return write_jsonl(tmp_path / "math.jsonl", MATH)


def error_of(excinfo, key="data.path"):
    assert set(excinfo.value.errors) == {key}
    return excinfo.value.errors[key]


def test_math_rows_become_problems(math_file):
    task = JsonlTask(math_file, kind="math", template="Q: {prompt}\nA:")
    assert task.train_size == 3
    assert task.problem(0) == Problem(id="math:0", prompt="Q: What is 1/4 + 1/4?\nA:",
                                      answer="\\frac{1}{2}", kind="math")
    p = task.problem(1)
    assert p.id == "sets"
    assert p.prompt == "Q: Solve {x | x > 2} ∩ {x | x < 3}.\nA:"   # braces survive the template
    assert task.problem(2).answer == 42
    assert task.index_of("sets") == 1
    with pytest.raises(IndexError, match="row 3 is out of range"):
        task.problem(3)


def test_code_rows_carry_tests_and_entry_point(tmp_path):
    task = JsonlTask(write_jsonl(tmp_path / "code.jsonl", CODE), kind="code")
    p = task.problem(1)
    assert (p.id, p.kind, p.prompt) == ("code:1", "code", "Write neg(x).")
    assert p.answer == {"tests": ["assert neg(1) == -1", "assert neg(0) == 0"], "entry_point": "neg"}
    assert task.problem(0).answer == {"tests": "assert add(1, 2) == 3", "entry_point": "add"}


def test_eval_problems_come_from_eval_path_or_the_first_training_rows(tmp_path, math_file):
    task = JsonlTask(math_file, kind="math")
    assert [p.id for p in task.eval_problems(2)] == ["math:0", "sets"]
    assert len(task.eval_problems(100)) == 3
    eval_path = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "1+1?", "answer": 2},
                                                      {"prompt": "2+2?", "answer": 4}])
    task = JsonlTask(math_file, kind="math", eval_path=eval_path)
    ev = task.eval_problems(5)
    assert [(p.id, p.prompt, p.answer) for p in ev] == [("math:eval:0", "1+1?", 2),
                                                         ("math:eval:1", "2+2?", 4)]
    assert task.eval_problems(1) == ev[:1]


def test_train_problem_visits_every_row_once_per_epoch(tmp_path):
    rows = [{"prompt": f"p{i}", "answer": i} for i in range(7)]
    task = JsonlTask(write_jsonl(tmp_path / "m.jsonl", rows), kind="math", seed=5)
    epochs = [[task.train_problem(e * 7 + k).answer for k in range(7)] for e in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(7))
    assert len({tuple(o) for o in epochs}) > 1   # each epoch has its own shuffle
    again = JsonlTask(write_jsonl(tmp_path / "m2.jsonl", rows), kind="math", seed=5)
    assert [again.train_problem(i).answer for i in range(21)] == sum(epochs, [])


def test_blank_lines_are_skipped_and_rows_count_objects_only(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", ["", json.dumps(MATH[0]), "   ", json.dumps(MATH[2])])
    task = JsonlTask(path, kind="math")
    assert task.train_size == 2 and task.problem(1).answer == 42


@pytest.mark.parametrize("rows, kind, message", [
    ([MATH[0], {"prompt": "x"}], "math", "line 2: missing 'answer'"),
    ([MATH[0], MATH[0], '{"prompt": "x", "answer": 1'], "math", "line 3: invalid JSON"),
    (['[1, 2]'], "math", "line 1: expected a JSON object, got a list"),
    ([{"answer": 1}], "math", "line 1: missing 'prompt'"),
    ([{"prompt": 3, "answer": 1}], "math", "line 1: 'prompt' must be a string or a list of messages, got a number"),
    ([{"prompt": "x", "answer": True}], "math", "line 1: 'answer' must be a string or a number"),
    ([{"prompt": "x", "answer": None}], "math", "line 1: 'answer' must be a string or a number, got null"),
    ([{"prompt": "x", "answer": "  "}], "math", "line 1: 'answer' is empty"),
    ([{"prompt": "", "answer": "1"}], "math", "line 1: 'prompt' is empty"),
    ([{"prompt": "x", "answer": 1, "id": "a"}, {"prompt": "y", "answer": 2, "id": "a"}], "math",
     "line 2: duplicate id 'a' (first used on line 1)"),
    ([{"prompt": "x", "answer": 1, "id": [1]}], "math", "line 1: 'id' must be a string or an integer"),
    ([{"prompt": "x", "entry_point": "f"}], "code", "line 1: missing 'tests'"),
    ([{"prompt": "x", "tests": "assert f()"}], "code", "line 1: missing 'entry_point'"),
    ([{"prompt": "x", "tests": 5, "entry_point": "f"}], "code",
     "line 1: 'tests' must be a string or a list, got a number"),
    ([{"prompt": "x", "tests": [], "entry_point": "f"}], "code", "line 1: 'tests' is an empty list"),
    ([{"prompt": "x", "tests": ["assert f()", 3], "entry_point": "f"}], "code",
     "line 1: 'tests'[1] must be a string"),
    ([{"prompt": "x", "tests": "assert f(", "entry_point": "f"}], "code",
     "line 1: 'tests' is not valid Python"),
    ([{"prompt": "x", "tests": "assert f()", "entry_point": "not a name"}], "code",
     "line 1: 'entry_point' must be a Python function name"),
])
def test_validation_errors_name_the_line_and_the_field(tmp_path, rows, kind, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ConfigError) as e:
        JsonlTask(path, kind=kind)
    text = error_of(e)
    assert message in text
    assert path in text


def test_all_bad_lines_are_reported_at_once(tmp_path):
    rows = [MATH[0]] + [{"prompt": "x"}] * 8
    with pytest.raises(ConfigError) as e:
        JsonlTask(write_jsonl(tmp_path / "bad.jsonl", rows), kind="math")
    text = error_of(e)
    assert "line 2: missing 'answer'" in text and "line 6: missing 'answer'" in text
    assert "and 3 more bad lines" in text


def test_missing_empty_and_undecodable_files(tmp_path):
    with pytest.raises(ConfigError) as e:
        JsonlTask(str(tmp_path / "nope.jsonl"), kind="math")
    assert "nope.jsonl: file not found" in error_of(e)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError) as e:
        JsonlTask(str(tmp_path / "empty.jsonl"), kind="math")
    assert "no problems" in error_of(e)
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9", "answer": 1}\n')
    with pytest.raises(ConfigError) as e:
        JsonlTask(str(tmp_path / "latin1.jsonl"), kind="math")
    assert "line 1: not valid UTF-8" in error_of(e)
    with pytest.raises(ConfigError) as e:
        JsonlTask("", kind="math")
    assert "needs a JSONL file" in error_of(e)


def test_eval_file_errors_use_the_eval_path_key(tmp_path, math_file):
    bad = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "x"}])
    with pytest.raises(ConfigError) as e:
        JsonlTask(math_file, kind="math", eval_path=bad)
    assert "line 1: missing 'answer'" in error_of(e, "data.eval_path")


def test_bad_kind_and_template(math_file):
    with pytest.raises(ConfigError) as e:
        JsonlTask(math_file, kind="sum")
    assert "data.task" in e.value.errors
    with pytest.raises(ConfigError) as e:
        JsonlTask(math_file, kind="math", template="no placeholder")
    assert "data.prompt_template" in e.value.errors


def test_build_task_reads_the_data_section(math_file):
    cfg = Config()
    cfg.set("data.task", "math")
    cfg.set("data.path", math_file)
    cfg.set("data.prompt_template", "Problem: {prompt}")
    cfg.set("run.seed", 9)
    task = build_task(cfg)
    assert isinstance(task, JsonlTask) and task.seed == 9 and task.train_size == 3
    assert task.problem(2).prompt == "Problem: What is 6 * 7?"


# --- size limit and streaming -------------------------------------------------------------------

def test_a_file_over_the_size_limit_is_refused_naming_its_size_and_the_limit(tmp_path, monkeypatch):
    path = tmp_path / "big.jsonl"
    write_jsonl(path, [{"prompt": "p" * 100, "answer": "1"}] * 30)
    monkeypatch.setenv("RLPILOT_MAX_DATA_BYTES", "1000")
    with pytest.raises(ConfigError) as e:
        JsonlTask(str(path), "math")
    msg = error_of(e)
    assert f"{path.stat().st_size} bytes" in msg and "1000 bytes" in msg
    assert "RLPILOT_MAX_DATA_BYTES" in msg
    monkeypatch.setenv("RLPILOT_MAX_DATA_BYTES", str(path.stat().st_size))  # at the limit: read
    assert JsonlTask(str(path), "math").train_size == 30


def test_a_bad_size_limit_setting_is_named(tmp_path, monkeypatch, math_file):
    for bad, says in (("lots", "whole number"), ("0", "positive")):
        monkeypatch.setenv("RLPILOT_MAX_DATA_BYTES", bad)
        with pytest.raises(ConfigError) as e:
            JsonlTask(str(math_file), "math")
        assert says in e.value.errors["RLPILOT_MAX_DATA_BYTES"]


def test_memory_grows_with_the_rows_kept_not_the_file(tmp_path):
    """40 rows of 1 MiB each, whose bulk is a field the task ignores: the rows kept are small,
    and reading line by line never holds the whole file."""
    import tracemalloc

    path = tmp_path / "padded.jsonl"
    with path.open("w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": f"q{i}", "answer": str(i), "pad": "x" * 2**20}) + "\n")
    size = path.stat().st_size
    assert size > 40 * 2**20  # guard: the file is far larger than any one line
    tracemalloc.start()
    try:
        task = JsonlTask(str(path), "math")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert task.train_size == 40 and task.problem(39).answer == "39"
    assert peak < size / 4, f"peak {peak / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB file"
