"""RewardService: batches scored in kept-alive worker processes, under a time limit."""
import os
import textwrap
import time

import psutil
import pytest

from trainer.rewards.pool import RewardBatch, RewardService
from trainer.tasks.base import Problem
from trainer.tasks.sum import SumTask

ADD = {"tests": "assert add(1, 2) == 3", "entry_point": "add"}


def sum_batch(n=200):
    task = SumTask(train_size=n, seed=3)
    problems = [task.problem(i) for i in range(n)]
    completions = [f">{p.answer}" if i % 3 else f">{p.answer + 1}" for i, p in enumerate(problems)]
    expected = [1.0 if i % 3 else 0.0 for i in range(n)]
    return problems, completions, expected


def children():
    return {p.pid for p in psutil.Process().children(recursive=True)}


def sandboxed_interpreters() -> list[int]:
    """Sandboxed interpreters (python -I) running under this process. A zombie runs nothing and
    has no command line: an earlier test's unreaped child is none of the pool's business."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "-I" in p.cmdline():
                found.append(p.pid)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            pass
    return found


def workers(before: set[int]) -> set[int]:
    """The reward workers: this process's direct children started since `before` (a worker's own
    sandboxed runs are its children, not ours)."""
    return {p.pid for p in psutil.Process().children()} - before


@pytest.fixture
def slow_rewards(tmp_path, monkeypatch):
    """A reward function module that hangs on "hang" and kills its process on "crash"."""
    (tmp_path / "slow_rewards_mod.py").write_text(textwrap.dedent("""
        import os, time
        from trainer.rewards.dispatch import score
        from trainer.rewards.judge import judge as run_code

        def reward(kind, answer, completion):
            if completion == "hang":
                time.sleep(60)
            if completion == "hang in a sandbox":   # ignores the batch's time limit
                run_code("import time; time.sleep(60)", [], "f", timeout_s=60)
            if completion == "crash":
                os._exit(7)
            return score(kind, answer, completion)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return "slow_rewards_mod:reward"


def test_pool_scores_the_sum_task_and_stays_alive_between_batches():
    problems, completions, expected = sum_batch()
    before = children()
    with RewardService(workers=2, timeout_s=30) as svc:
        pids = workers(before)
        assert len(pids) == 2
        first = svc.score_batch(problems, completions)
        for _ in range(3):
            b = svc.score_batch(problems, completions)
        assert workers(before) == pids   # the same processes: no start-up per batch
    assert first.scores == expected and b.scores == expected
    assert (b.errors, b.timeouts) == (0, 0) and b.statuses == ["ok"] * len(expected)


def test_in_process_scoring_matches_the_pool():
    problems, completions, expected = sum_batch(50)
    before = children()
    with RewardService(workers=0) as svc:
        b = svc.score_batch(problems, completions)
        assert workers(before) == set()
    assert b.scores == expected


@pytest.mark.parametrize("workers", [0, 1])
def test_a_reward_that_raises_counts_as_an_error(workers):
    problems = [Problem("a", "p", "not-a-number", "sum"), Problem("b", "p", 3, "sum"),
                Problem("c", "p", 3, "no-such-kind"), Problem("d", "p", 3, "sum")]
    completions = [">3", ">3", ">3", None]
    with RewardService(workers=workers, timeout_s=30) as svc:
        b = svc.score_batch(problems, completions)
    assert b.scores == [0.0, 1.0, 0.0, 0.0]
    assert (b.errors, b.timeouts) == (3, 0)
    assert b.statuses == ["error", "ok", "error", "error"]
    assert "no-such-kind" in b.notes[2]


def test_a_timeout_is_counted_and_the_pool_works_afterwards(slow_rewards):
    problems = [Problem("a", "p", 3, "sum"), Problem("b", "p", 4, "sum")]
    before = children()
    with RewardService(workers=1, timeout_s=1.0, reward_fn=slow_rewards) as svc:
        assert svc.score_batch(problems, [">3", ">4"]).scores == [1.0, 1.0]
        old = workers(before)
        t0 = time.monotonic()
        b = svc.score_batch(problems, ["hang", ">4"])
        assert time.monotonic() - t0 < 5
        assert b.scores == [0.0, 0.0] and b.timeouts == 2 and b.errors == 0
        assert b.statuses == ["timeout", "timeout"]
        new = workers(before)
        assert len(old) == len(new) == 1 and not new & old   # killed (and reaped), replaced
        assert not any(psutil.pid_exists(pid) for pid in old)
        b = svc.score_batch(problems, [">3", ">4"])
        assert b.scores == [1.0, 1.0] and (b.errors, b.timeouts) == (0, 0)


def test_a_worker_that_dies_costs_one_item(slow_rewards):
    problems = [Problem(str(i), "p", i, "sum") for i in range(4)]
    with RewardService(workers=1, timeout_s=20, reward_fn=slow_rewards) as svc:
        b = svc.score_batch(problems, [">0", "crash", ">2", ">3"])
        assert b.scores == [1.0, 0.0, 1.0, 1.0]
        assert (b.errors, b.timeouts) == (1, 0) and "died" in b.notes[1]
        assert svc.score_batch(problems[:1], [">0"]).scores == [1.0]


def test_code_items_run_in_parallel_workers_with_their_own_timeouts():
    probs = [Problem(str(i), "p", ADD, "code") for i in range(4)]
    comps = ["def add(a, b): return a + b", "def add(a, b):\n    while True: pass",
             "def add(a, b): return a - b", "def add(a, b): return b + a"]
    before = children()
    with RewardService(workers=2, timeout_s=20, item_timeout_s=1.0) as svc:
        pids = workers(before)
        b = svc.score_batch(probs, comps)
        assert workers(before) == pids and len(pids) == 2   # an item timeout does not cost a worker
    assert b.scores == [1.0, 0.0, 0.0, 1.0]
    assert b.statuses == ["ok", "timeout", "ok", "ok"] and b.timeouts == 1


def test_close_leaves_no_child_processes(slow_rewards):
    before = children()
    svc = RewardService(workers=2, timeout_s=1.0, reward_fn=slow_rewards)
    probs = [Problem("a", "p", ADD, "code"), Problem("b", "p", 1, "sum")]
    svc.score_batch(probs, ["def add(a, b): return a + b", ">1"])
    svc.score_batch([Problem("c", "p", 1, "sum")], ["hang"])   # a worker is killed and replaced
    b = svc.score_batch([Problem("d", "p", 1, "sum")], ["hang in a sandbox"])
    assert b.timeouts == 1
    # The worker was killed together with the sandboxed interpreter it had started.
    assert len(children() - before) == 2
    assert not sandboxed_interpreters()
    svc.close()
    svc.close()   # idempotent
    deadline = time.monotonic() + 5
    while children() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert children() - before == set()
    with pytest.raises(RuntimeError, match="closed"):
        svc.score_batch([], [])


def test_empty_batch_and_mismatched_lengths():
    with RewardService(workers=1) as svc:
        assert svc.score_batch([], []) == RewardBatch([], 0, 0, [], [])
        with pytest.raises(ValueError, match="2 problems but 1 completions"):
            svc.score_batch([Problem("a", "p", 1, "sum")] * 2, [">1"])


def test_bad_arguments():
    with pytest.raises(ValueError, match="workers"):
        RewardService(workers=-1)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardService(timeout_s=0)
    with pytest.raises(ValueError, match="no_such_module"):
        RewardService(workers=0, reward_fn="no_such_module:f")
