"""trainer/cluster/launch.py: torchrun's command line, and a torchrun child that cannot outlive its
parent. The ranks here are a tiny script (no training): each writes its pid and sleeps, so the
tests see exactly which processes torchrun started and whether they are gone.

- the parent (a Python process holding a TorchrunProcess) SIGKILLed: torchrun and both ranks
  end (PR_SET_PDEATHSIG on torchrun, which forwards SIGTERM to its ranks);
- torchrun itself SIGKILLed: the ranks end (die_with_launcher);
- stop(): everything ends; a failing rank: a non-zero status and its error in the stderr tail;
- `python -m trainer run PRESET --set cluster.train_procs=2` re-launches itself under torchrun.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from trainer.cluster import launch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")]

RANK = textwrap.dedent("""
    import os, sys, time
    from trainer.cluster.launch import die_with_launcher
    die_with_launcher()
    out = sys.argv[1]
    with open(os.path.join(out, f"rank{os.environ['RANK']}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if sys.argv[2:] == ["fail"] and os.environ["RANK"] == "1":
        raise RuntimeError("rank 1 cannot go on: bad input")
    time.sleep(600)
""")

PARENT = textwrap.dedent("""
    import sys, time
    from trainer.cluster.launch import TorchrunProcess, torchrun_argv
    proc = TorchrunProcess(torchrun_argv([sys.argv[1], sys.argv[2]], nproc=2)).start()
    with open(sys.argv[2] + "/torchrun.pid", "w") as f:
        f.write(str(proc.pid))
    time.sleep(600)
""")


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def _wait(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pids(out: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in out.glob("*.pid") if p.read_text().strip()}


def _started(out: Path) -> dict[str, int]:
    """torchrun's pid and both ranks', once all three are written."""
    return _wait(lambda: (lambda p: p if {"rank0", "rank1"} <= set(p) else None)(_pids(out)),
                 "both ranks to start")


@pytest.fixture
def rank_script(tmp_path):
    path = tmp_path / "rank.py"
    path.write_text(RANK)
    return path


def test_argv_one_machine_and_several():
    one = launch.torchrun_argv(["-m", "trainer", "run", "demo"], nproc=2, python="py")
    assert one == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   "-m", "trainer", "run", "demo"]
    many = launch.torchrun_argv(["train.py"], nproc=8, nnodes=2, rdzv_endpoint="h1:29400",
                                rdzv_id="run7", node_rank=1, python="py")
    assert "--standalone" not in many
    assert many[many.index("--nnodes") + 1] == "2" and many[many.index("--rdzv_endpoint") + 1] == "h1:29400"
    assert many[many.index("--rdzv_id") + 1] == "run7" and many[many.index("--node_rank") + 1] == "1"
    assert many[-3:] == ["--nproc_per_node", "8", "train.py"]
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        launch.torchrun_argv(["train.py"], nproc=2, nnodes=2)
    with pytest.raises(ValueError, match="nproc"):
        launch.torchrun_argv(["train.py"], nproc=0)


def test_layout_text():
    assert launch.layout_text(1, 0) == "1 process"
    assert launch.layout_text(2, 1) == "2 training processes + 1 generation process"
    assert launch.layout_text(1, 2) == "1 training process + 2 generation processes"
    assert launch.layout_text(2, 1, "fsdp") == "2 training processes (model sharded) + 1 generation process"
    assert launch.layout_text(1, 1, "fsdp") == "1 training process + 1 generation process"   # nothing to shard


def test_torchrun_dies_with_its_sigkilled_parent(tmp_path, rank_script):
    parent_py = tmp_path / "parent.py"
    parent_py.write_text(PARENT)
    out = tmp_path / "pids"
    out.mkdir()
    parent = subprocess.Popen([sys.executable, str(parent_py), str(rank_script), str(out)],
                              env=_env(), cwd=ROOT, start_new_session=True)
    try:
        pids = _started(out)
        assert set(pids) == {"torchrun", "rank0", "rank1"}
        assert all(_alive(p) for p in pids.values()), pids
        # torchrun runs the ranks (its children), in a session other than the parent's
        assert {c.pid for c in psutil.Process(pids["torchrun"]).children()} >= {pids["rank0"], pids["rank1"]}
        assert os.getsid(pids["torchrun"]) != os.getsid(parent.pid)
        parent.send_signal(signal.SIGKILL)   # what Celery's terminate does to a worker child
        parent.wait(10)
        _wait(lambda: not any(_alive(p) for p in pids.values()),
              f"torchrun and its ranks to end with their parent: {pids}")
    finally:
        for pid in [parent.pid, *_pids(out).values()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        parent.wait(10)


def test_ranks_die_with_a_sigkilled_torchrun_and_stop_ends_everything(tmp_path, rank_script):
    out = tmp_path / "pids"
    out.mkdir()
    proc = launch.TorchrunProcess(launch.torchrun_argv([str(rank_script), str(out)], nproc=2),
                                  env=_env(), cwd=str(ROOT)).start()
    (out / "torchrun.pid").write_text(str(proc.pid))
    try:
        pids = _started(out)
        os.kill(proc.pid, signal.SIGKILL)   # no chance to forward anything
        _wait(lambda: not _alive(pids["rank0"]) and not _alive(pids["rank1"]),
              f"the ranks to end with torchrun: {pids}")
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        proc.stop(grace_s=5)

    again = launch.TorchrunProcess(launch.torchrun_argv([str(rank_script), str(out)], nproc=2),
                                   env=_env(), cwd=str(ROOT))
    for p in out.glob("*.pid"):
        p.unlink()
    again.start()
    pids = _started(out)
    rc = again.stop(grace_s=20)
    assert rc != 0
    assert not _alive(again.pid) and not any(_alive(p) for p in pids.values()), pids


def test_a_failing_rank_gives_a_status_and_its_error(tmp_path, rank_script):
    out = tmp_path / "pids"
    out.mkdir()
    proc = launch.TorchrunProcess(launch.torchrun_argv([str(rank_script), str(out), "fail"], nproc=2),
                                  env=_env(), cwd=str(ROOT)).start()
    try:
        rc = proc.wait(90)
    finally:
        proc.stop(grace_s=5)
    assert rc != 0
    assert "rank 1 cannot go on: bad input" in proc.stderr_tail(200), proc.stderr_tail(200)
    # the error message: the rank's own lines, not torchrun's report of which rank exited
    error = proc.error_tail(5)
    assert error.endswith("RuntimeError: rank 1 cannot go on: bad input"), error
    assert "ChildFailedError" not in error and "ChildFailedError" in proc.stderr_tail(200)
    assert not any(_alive(p) for p in _pids(out).values())


def test_the_cli_relaunches_itself_under_torchrun(tmp_path):
    out = tmp_path / "run"
    sets = ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "rollout.max_response_len=48",
            "rollout.max_slots=16", "run.eval_every=0", "run.checkpoint_every=0", "run.reward_workers=0",
            "model.threads=1", "run.max_steps=2", "cluster.train_procs=2"]
    cmd = [sys.executable, "-m", "trainer", "run", "demo", "--out", str(out)]
    for s in sets:
        cmd += ["--set", s]
    env = {k: v for k, v in _env().items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(env, RLPILOT_DIST_TIMEOUT_S="90"), capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "training under torchrun" in proc.stdout
    summaries = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"status"')]
    assert len(summaries) == 1 and summaries[0]["samples_total"] == 32   # rank 0's, over both ranks
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["dist/world_size"] == 2
