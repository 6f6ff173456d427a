"""Sandbox cgroups left by a process killed mid-call are removed (trainer/sandbox/cgroup.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.sandbox import cgroup
from trainer.sandbox.cgroup import PREFIX, Cgroup, group_name, maker, sweep


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_group_is_named_after_its_maker():
    assert maker(group_name()) == os.getpid()
    assert maker(PREFIX + "0123456789ab") is None            # an older version's name
    assert maker("rlpilot-sandbox-12x-ab") is None


def test_sweep_removes_the_empty_groups_of_gone_makers_and_nothing_else(tmp_path):
    gone = tmp_path / f"{PREFIX}{dead_pid()}-00aa11bb22cc"
    mine = tmp_path / f"{PREFIX}{os.getpid()}-00aa11bb22cc"
    busy = tmp_path / f"{PREFIX}{dead_pid()}-33dd44ee55ff"      # a process is still in it
    old = tmp_path / f"{PREFIX}0123456789ab"                     # no maker in the name
    other = tmp_path / "someone-else"
    for d in (gone, mine, busy, old, other):
        d.mkdir()
    (busy / "cgroup.procs").write_text("4242\n")   # (rmdir refuses it, as the kernel would)
    assert sweep(tmp_path) == []   # too young: a maker in another PID namespace looks gone
    for d in (gone, mine, busy, old, other):
        age(d, cgroup.MIN_AGE_S + 1)
    assert sweep(tmp_path) == [gone]
    assert {d.name for d in tmp_path.iterdir()} == {mine.name, busy.name, old.name, other.name}
    age(old, cgroup.STALE_S + 1)
    assert sweep(tmp_path) == [old]


def age(d: Path, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(d, (past, past))


MAKE_AND_DIE = """
import os, sys
from trainer.sandbox.cgroup import Cgroup
g = Cgroup.make(pids=8, memory_bytes=64 << 20)
print("\\n".join(str(d) for d in g.dirs) if g else "", flush=True)
os._exit(0)   # as a reward worker killed mid-call: its group is never removed
"""


def test_a_group_left_by_a_killed_process_is_removed_by_the_next_maker(monkeypatch):
    probe = Cgroup.make(pids=8, memory_bytes=64 << 20)
    if probe is None:
        pytest.skip("no cgroup can be made here (no permission or no controller)")
    probe.remove()
    out = subprocess.run([sys.executable, "-c", MAKE_AND_DIE], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parent.parent).stdout
    left = [Path(p) for p in out.split()]
    assert left and all(d.is_dir() for d in left)
    for d in left:
        age(d, cgroup.MIN_AGE_S + 1)
    monkeypatch.setattr(cgroup, "_swept", set())   # this process makes its first group again
    group = Cgroup.make(pids=8, memory_bytes=64 << 20)
    try:
        assert not any(d.exists() for d in left)
    finally:
        group.remove()
