"""Run a command in this process group and end the whole group when the process that started us
dies: `python group_guard.py PARENT_PID -- CMD...` (run by path, so it imports nothing of rlpilot).

Why: an SGLang server is a launcher plus scheduler and detokenizer processes, and its CPU
scheduler spins a core even idle (unless started with --sleep-on-idle, as SGLangServer does
now). A trainer or test process that is SIGKILLed never runs
SGLangServer.stop(), and its server then ran on (seen: an orphaned scheduler at 80% of a core for
20 minutes, slowing everything on a 2-core machine). PR_SET_PDEATHSIG is no answer: it follows the
thread that forked, and reaches only the direct child, not the scheduler it spawns. This guard is
the group's leader (the caller starts it in a session of its own), polls its parent once a second,
and signals the group -- SIGTERM, then SIGKILL -- when the parent is gone; it exits with the
command's status when the command ends first. A signal to the group (SGLangServer.stop) reaches it
too: it passes it on to the command and leaves with the group.
"""
import os
import signal
import subprocess
import sys
import time

POLL_S = 1.0
GRACE_S = 10.0


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: group_guard.py PARENT_PID -- CMD...", file=sys.stderr)
        return 2
    parent, cmd = int(argv[0]), argv[2:]
    child = subprocess.Popen(cmd)   # same process group: a killpg reaches both

    def forward(sig, _frame):
        child.send_signal(sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        try:
            return child.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != parent:   # re-parented: the process that started us is gone
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.killpg(0, signal.SIGTERM)
            deadline = time.monotonic() + GRACE_S
            while child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            os.killpg(0, signal.SIGKILL)   # the scheduler and detokenizer too, and this guard


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
