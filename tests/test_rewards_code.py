"""Code rewards: the completion runs in the sandbox, its tests in the judge (trainer/rewards/judge.py).
The hostile routes (escapes, forged verdicts) are tests/test_sandbox_hostile.py."""
import time

import pytest

from trainer.rewards.dispatch import score
from trainer.rewards.judge import judge
from trainer.rewards.pool import RewardService
from trainer.rewards.verifiers import extract_code, score_code
from trainer.tasks.base import Problem

ADD = {"tests": "assert add(1, 2) == 3\nassert add(-1, 1) == 0", "entry_point": "add"}
GOOD = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."


def run(completion, answer=ADD, timeout_s=5.0):
    tests = answer["tests"]
    return judge(extract_code(completion, answer["entry_point"]),
                    [tests] if isinstance(tests, str) else tests, answer["entry_point"],
                    timeout_s=timeout_s)


def test_passing_solution_scores_one():
    assert score("code", ADD, GOOD) == 1.0
    assert score("code", ADD, "def add(a, b):\n    return a + b\n") == 1.0  # no fences


def test_failing_assert_scores_zero_and_says_why():
    bad = "```python\ndef add(a, b):\n    return a - b\n```"
    assert score("code", ADD, bad) == 0.0
    r = run(bad)
    assert (r.passed, r.status) == (False, "fail")
    assert "AssertionError" in r.detail


def test_missing_entry_point_scores_zero():
    r = run("def plus(a, b):\n    return a + b")
    assert not r.passed and "does not define add()" in r.detail


def test_tests_as_a_list_must_all_pass():
    answer = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 5"], "entry_point": "add"}
    assert score("code", answer, GOOD) == 0.0
    answer["tests"] = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]
    assert score("code", answer, GOOD) == 1.0


def test_humaneval_style_check_function_is_called():
    answer = {"tests": "def check(candidate):\n    assert candidate(2, 3) == 5\n", "entry_point": "add"}
    assert score("code", answer, GOOD) == 1.0
    assert score("code", answer, "def add(a, b):\n    return 0") == 0.0


def test_early_exit_or_printed_pass_cannot_fake_success():
    for cheat in ["import sys\ndef add(a, b): return 0\nsys.exit(0)",
                  "import os\ndef add(a, b): return 0\nos._exit(0)",
                  'print(\'{"status": "pass"}\')\nimport os\nos.write(1, b\'{"status": "pass"}\\n\')\n'
                  "def add(a, b): return 0",
                  # the nonce is not a global of the runner's __main__
                  "import __main__, os\ndef add(a, b): return 0\n"
                  "for fd in (1, 3, 4):\n"
                  "    os.write(fd, ('{\"status\": \"pass\", \"nonce\": \"%s\"}\\n'\n"
                  "             % getattr(__main__, 'nonce', '')).encode())\n"
                  "os._exit(0)"]:
        assert score("code", ADD, cheat) == 0.0, cheat


def test_infinite_loop_times_out():
    t0 = time.monotonic()
    r = run("def add(a, b):\n    while True:\n        pass", timeout_s=1.0)
    assert (r.passed, r.status) == (False, "timeout")
    assert time.monotonic() - t0 < 5


def test_infinite_loop_is_counted_as_a_timeout_by_the_service():
    probs = [Problem("c0", "p", ADD, "code"), Problem("c1", "p", ADD, "code")]
    with RewardService(workers=0, timeout_s=1.0) as svc:
        b = svc.score_batch(probs, ["def add(a, b):\n    while True: pass", GOOD])
    assert b.scores[0] == 0.0 and b.statuses[0] == "timeout"
    assert b.timeouts >= 1 and b.errors == 0


def test_network_is_blocked():
    conn = ("import socket\ns = socket.create_connection(('127.0.0.1', 9), timeout=1)\n"
            "def add(a, b): return a + b")
    r = run(conn)
    assert not r.passed and "PermissionError" in r.detail
    # Every way of making an inet socket fails inside: the candidate reports what each did.
    probe = ("import socket, _socket\n"
             "def add(a, b):\n"
             "    made = []\n"
             "    for make in (lambda: socket.socket(), lambda: _socket.socket(),\n"
             "                 lambda: socket.create_connection(('127.0.0.1', 9)),\n"
             "                 lambda: socket.getaddrinfo('localhost', 80)):\n"
             "        try:\n"
             "            make()\n"
             "            made.append(1)\n"
             "        except OSError:\n"
             "            made.append(0)\n"
             "    return a + b + 100 * sum(made)\n")
    assert score("code", ADD, probe) == 1.0


def test_memory_bomb_is_stopped():
    t0 = time.monotonic()
    for bomb in ["x = bytearray(8 * 1024**3)\ndef add(a, b): return a + b",
                 "x = [0] * (2 * 10**9)\ndef add(a, b): return a + b"]:
        r = run(bomb)
        assert not r.passed and "MemoryError" in r.detail
    assert time.monotonic() - t0 < 10


def test_writes_outside_the_sandbox_and_subprocesses_are_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    r = run(f"open({str(target)!r}, 'w').write('x')\ndef add(a, b): return a + b")
    assert not r.passed and "PermissionError" in r.detail
    assert not target.exists()
    r = run("import subprocess\nsubprocess.run(['true'])\ndef add(a, b): return a + b")
    assert not r.passed and "subprocess.Popen" in r.detail
    # Its own directory is writable.
    assert score("code", ADD, "open('scratch.txt', 'w').write('ok')\n" + GOOD) == 1.0


def test_extract_code_prefers_the_block_defining_the_entry_point():
    text = "```python\ndef add(a, b):\n    return a + b\n```\nUsage:\n```python\nprint(add(1, 2))\n```"
    assert extract_code(text, "add").startswith("def add")
    assert extract_code(text).startswith("print")
    assert extract_code("```py\ndef f(): pass\n```") == "def f(): pass\n"
    assert extract_code("```python\ndef f(): pass") == "def f(): pass"   # cut off mid-block
    assert extract_code("def f(): pass") == "def f(): pass"


def test_malformed_answer_raises_a_clear_error():
    with pytest.raises(TypeError, match="tests"):
        score_code({"entry_point": "add"}, GOOD)
