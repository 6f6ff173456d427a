"""`rlpilot reward`: offline scoring of a completions file against a dataset."""
import argparse
import json

import pytest

from trainer.cli import reward as reward_cli


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def parser():
    p = argparse.ArgumentParser(prog="rlpilot")
    reward_cli.add_parser(p.add_subparsers(dest="command", required=True))
    return p


def main(argv, capsys):
    args = parser().parse_args(argv)
    assert args.func is reward_cli.run
    code = reward_cli.run(args)
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


@pytest.fixture
def math_data(tmp_path):
    return write_jsonl(tmp_path / "math.jsonl", [
        {"id": "half", "prompt": "1/4 + 1/4?", "answer": "1/2"},
        {"prompt": "6 * 7?", "answer": 42},
    ])


def test_scores_math_completions_by_id_and_index(tmp_path, math_data, capsys):
    comps = write_jsonl(tmp_path / "c.jsonl", [
        {"id": "half", "completion": "\\boxed{0.5}"},
        {"id": "half", "completion": "\\boxed{\\frac12}"},
        {"id": "half", "completion": "it is 1/3"},
        {"index": 1, "completion": "The answer is 42."},
        {"id": "math:1", "completion": "\\boxed{41}"},
    ])
    code, out, err = main(["reward", "--dataset", math_data, "--completions", comps,
                           "--workers", "0"], capsys)
    assert code == 0, err
    assert out == {"n": 5, "mean_reward": 0.6, "accuracy": 0.6, "errors": 0, "timeouts": 0,
                   "unknown_ids": []}


def test_details_list_every_item(tmp_path, math_data, capsys):
    comps = write_jsonl(tmp_path / "c.jsonl", [{"index": 0, "completion": "\\boxed{1/2}"}, "",
                                               {"id": "math:1", "completion": "no idea"}])
    code, out, _ = main(["reward", "--dataset", math_data, "--completions", comps,
                         "--workers", "1", "--details"], capsys)
    assert code == 0
    assert out["items"] == [
        {"line": 1, "id": "half", "index": 0, "score": 1.0, "status": "ok"},
        {"line": 3, "id": "math:1", "index": 1, "score": 0.0, "status": "ok"},
    ]


def test_code_task_is_inferred_and_scored_in_workers(tmp_path, capsys):
    data = write_jsonl(tmp_path / "code.jsonl", [
        {"id": "add", "prompt": "Write add.", "tests": "assert add(1, 2) == 3", "entry_point": "add"}])
    comps = write_jsonl(tmp_path / "c.jsonl", [
        {"id": "add", "completion": "```python\ndef add(a, b):\n    return a + b\n```"},
        {"id": "add", "completion": "def add(a, b):\n    return a * b"},
        {"id": "add", "completion": "def add(a, b):\n    while True: pass"},
    ])
    code, out, _ = main(["reward", "--dataset", data, "--completions", comps, "--workers", "2",
                         "--timeout", "1", "--details"], capsys)
    assert code == 0
    assert (out["n"], out["accuracy"], out["timeouts"], out["errors"]) == (3, pytest.approx(1 / 3), 1, 0)
    assert [i["status"] for i in out["items"]] == ["ok", "ok", "timeout"]
    assert "AssertionError" in out["items"][1]["note"]


def test_unknown_ids_are_listed_and_exit_2(tmp_path, math_data, capsys):
    comps = write_jsonl(tmp_path / "c.jsonl", [
        {"id": "half", "completion": "\\boxed{1/2}"},
        {"id": "nope", "completion": "1"},
        {"id": "nope", "completion": "2"},
        {"index": 9, "completion": "3"},
    ])
    code, out, err = main(["reward", "--dataset", math_data, "--completions", comps,
                           "--workers", "0"], capsys)
    assert code == 2
    assert out["n"] == 1 and out["mean_reward"] == 1.0
    assert out["unknown_ids"] == ["nope", 9]
    assert "match no problem" in err and '"nope"' in err


@pytest.mark.parametrize("lines, message", [
    (['{"id": "half", "completion": "1"}', '{"id": "half", "completion": '], "line 2: invalid JSON"),
    (['{"id": "half"}'], "line 1: missing 'completion'"),
    (['{"completion": "1"}'], "line 1: give exactly one of 'id' and 'index'"),
    (['{"index": "0", "completion": "1"}'], "line 1: 'index' must be an integer"),
    (['{"id": "half", "completion": 5}'], "line 1: 'completion' must be a string"),
    ([""], "no completions"),
])
def test_bad_completions_file_exits_2_with_the_line(tmp_path, math_data, capsys, lines, message):
    comps = write_jsonl(tmp_path / "c.jsonl", lines)
    code, out, err = main(["reward", "--dataset", math_data, "--completions", comps], capsys)
    assert code == 2 and out is None
    assert message in err and "c.jsonl" in err


def test_missing_files_and_bad_dataset_exit_2(tmp_path, math_data, capsys):
    comps = write_jsonl(tmp_path / "c.jsonl", [{"index": 0, "completion": "1"}])
    code, _, err = main(["reward", "--dataset", str(tmp_path / "no.jsonl"), "--completions", comps],
                        capsys)
    assert code == 2 and "no.jsonl: file not found" in err
    code, _, err = main(["reward", "--dataset", math_data, "--completions",
                         str(tmp_path / "none.jsonl")], capsys)
    assert code == 2 and "none.jsonl" in err and "file not found" in err
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x", "answer": 1}, {"prompt": "y"}])
    code, _, err = main(["reward", "--dataset", bad, "--completions", comps], capsys)
    assert code == 2 and "line 2: missing 'answer'" in err
    # --task overrides the inference: a math file read as code lacks 'tests'
    code, _, err = main(["reward", "--dataset", math_data, "--completions", comps,
                         "--task", "code"], capsys)
    assert code == 2 and "missing 'tests'" in err


def test_run_accepts_a_plain_namespace(tmp_path, math_data, capsys):
    comps = write_jsonl(tmp_path / "c.jsonl", [{"index": 1, "completion": "\\boxed{42}"}])
    args = argparse.Namespace(dataset=math_data, completions=comps, task=None, workers=0,
                              timeout=5.0, details=False)
    assert reward_cli.run(args) == 0
    assert json.loads(capsys.readouterr().out)["accuracy"] == 1.0
    args.workers = -3
    assert reward_cli.run(args) == 2
    assert "--workers" in capsys.readouterr().err
