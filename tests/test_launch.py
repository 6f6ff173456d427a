"""trainer/cluster/launch.py: torchrun's command line, and a torchrun child that cannot outlive its
parent. The ranks here are a tiny script (no training): each writes its pid and sleeps, so the
tests see exactly which processes torchrun started and whether they are gone.

- the parent (a Python process holding a TorchrunProcess) SIGKILLed: torchrun and both ranks
  end (PR_SET_PDEATHSIG on torchrun, which forwards SIGTERM to its ranks);
- torchrun itself SIGKILLed: the ranks end (die_with_launcher);
- stop(): everything ends; a failing rank: a non-zero status and its error in the stderr tail;
  a rank killed by a signal: named, with the signal, the step and where a resume continues (the
  same through the CLI on a real two-rank run, which then resumes);
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
from helpers import tiny_cli_run

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
    if sys.argv[2:] == ["kill"] and os.environ["RANK"] == "1":
        time.sleep(1)
        os.kill(os.getpid(), 9)
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


def _ranks_until_they_end(tmp_path, rank_script, how: str):
    """torchrun of the rank script with rank 1 ending `how` ("fail", "kill"): (torchrun, its
    status, the folder of the ranks' pids)."""
    out = tmp_path / "pids"
    out.mkdir()
    proc = launch.TorchrunProcess(launch.torchrun_argv([str(rank_script), str(out), how], nproc=2),
                                  env=_env(), cwd=str(ROOT)).start()
    try:
        rc = proc.wait(90)
    finally:
        proc.stop(grace_s=5)
    return proc, rc, out


def test_a_failing_rank_gives_a_status_and_its_error(tmp_path, rank_script):
    proc, rc, out = _ranks_until_they_end(tmp_path, rank_script, "fail")
    assert rc != 0
    assert "rank 1 cannot go on: bad input" in proc.stderr_tail(200), proc.stderr_tail(200)
    # the error message: the rank's own lines, not torchrun's report of which rank exited
    error = proc.failure(lines=5)
    assert error.endswith("RuntimeError: rank 1 cannot go on: bad input"), error
    assert "ChildFailedError" not in error and "ChildFailedError" in proc.stderr_tail(200)
    assert not any(_alive(p) for p in _pids(out).values())


REPORT = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
trainer FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-04_12:44:36
  host      : {host}
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 11134)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 11134
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-04_12:44:36
  host      : {host}
  rank      : {rank} (local_rank: 1)
  exitcode  : {code} (pid: 11135)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 11135
======================================================="""


@pytest.mark.parametrize("host, rank, code, words", [
    ("localhost", 1, -9, "training rank 1 was killed by SIGKILL (signal 9)"),
    ("gpu-node-7", 12, 1, "training rank 12 on gpu-node-7 exited with status 1"),
    ("localhost", 3, -6, "training rank 3 was killed by SIGABRT (signal 6)"),
])
def test_torchruns_report_of_the_first_failure_in_words(host, rank, code, words):
    lines = REPORT.format(host=host, rank=rank, code=code).splitlines()
    assert launch.failure_cause(lines) == words   # the root cause, not the rank torchrun then stopped
    assert launch.failure_cause(lines[:13]) is None   # no root cause: no guess


def test_a_rank_killed_by_a_signal_is_named_with_the_step_and_where_a_resume_continues(tmp_path, rank_script):
    proc, rc, out = _ranks_until_they_end(tmp_path, rank_script, "kill")
    assert rc != 0
    said = proc.failure(last_step=7, checkpoint_step=6)
    assert said == ("training rank 1 was killed by SIGKILL (signal 9) during step 8; "
                    "resume continues from the checkpoint at step 6"), said   # not torchrun's banner
    assert proc.failure().endswith("no checkpoint was written: a resume starts over")
    assert not any(_alive(p) for p in _pids(out).values())


def _rank_pids(torchrun_pid: int) -> dict[int, int]:
    """{rank: pid} of torchrun's rank processes."""
    out = {}
    for child in psutil.Process(torchrun_pid).children():
        try:
            rank = child.environ().get("RANK")
        except psutil.Error:
            continue
        if rank is not None:
            out[int(rank)] = child.pid
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_training_rank_killed_mid_run_ends_the_cli_run_with_its_cause_and_resume_continues(tmp_path):
    out = tmp_path / "run"
    cmd = tiny_cli_run(out, "run.checkpoint_every=1", "run.max_steps=500", "cluster.train_procs=2")
    env = {k: v for k, v in _env().items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["RLPILOT_DIST_TIMEOUT_S"] = "90"
    cli = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: (out / "checkpoints" / "step_000002").is_dir(), "two steps", timeout=150)
        torchrun = _wait(lambda: [c for c in psutil.Process(cli.pid).children(recursive=True)
                                  if "torch.distributed.run" in " ".join(c.cmdline())], "torchrun")[0]
        ranks = _wait(lambda: (lambda r: r if len(r) == 2 else None)(_rank_pids(torchrun.pid)), "the ranks")
        os.kill(ranks[1], signal.SIGKILL)
        _, err = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode != 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    last, saved = rows[-1]["step"], launch_checkpoint_step(out)
    said = next(line for line in err.splitlines() if line.startswith("run failed: "))
    assert said == (f"run failed: training rank 1 was killed by SIGKILL (signal 9) during step {last + 1}; "
                    f"resume continues from the checkpoint at step {saved}"), said
    assert f"python -m trainer run --resume {out}" in err
    assert not _alive(torchrun.pid) and not any(_alive(p) for p in ranks.values())
    resumed = subprocess.run([sys.executable, "-m", "trainer", "run", "--resume", str(out),
                              "--set", f"run.max_steps={saved + 1}"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=150)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == saved + 1


def launch_checkpoint_step(run_dir: Path) -> int:
    from trainer.run import checkpoint

    return checkpoint.latest_step(run_dir)


def test_the_cli_relaunches_itself_under_torchrun(tmp_path):
    out = tmp_path / "run"
    cmd = tiny_cli_run(out, "run.max_steps=2", "cluster.train_procs=2")
    env = {k: v for k, v in _env().items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(env, RLPILOT_DIST_TIMEOUT_S="90"), capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "training under torchrun" in proc.stdout
    summaries = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"status"')]
    assert len(summaries) == 1 and summaries[0]["samples_total"] == 32   # rank 0's, over both ranks
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["dist/world_size"] == 2
