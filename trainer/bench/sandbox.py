"""bench sandbox: what the isolation boundary costs, `process` (limits and an audit hook) against
`bwrap` (namespaces, seccomp, a cgroup), side by side in one process.

Three figures per isolation, interleaved so that a change in the machine's load falls on both:
- a trivial python tool call (`print(1 + 1)` through trainer/sandbox/snippet.py): median wall ms;
- one HumanEval-style code reward (a solution, a `check(candidate)` of `--asserts` asserts,
  through the judge: trainer/rewards/judge.py): median wall ms;
  (the single calls alternate: bwrap, process, process, bwrap, ...; `--calls` of each per round)
- the code-reward throughput of a batch: `--batch` completions (a quarter of them wrong) scored
  by the reward pool (`--workers` processes), samples per second; one batch per isolation and
  round, the order reversed every other round.
`ratio` holds bwrap's figure over process's (times: >1 is slower; throughput: <1 is slower).
`loadavg` is /proc/loadavg's 1-minute figure before and after: on a shared machine, say it with
the figures.
"""
from __future__ import annotations

import statistics
import time

NAME = "sandbox"
HELP = "the isolation boundary's cost per python tool call and per code reward (process vs bwrap)"

SOLUTION = ("```python\ndef add_all(xs):\n    total = 0\n    for x in xs:\n        total += x\n"
            "    return total\n```")
WRONG = "```python\ndef add_all(xs):\n    return 0\n```"


def add_arguments(p) -> None:
    p.add_argument("--reps", type=int, default=3, help="interleaved rounds")
    p.add_argument("--calls", type=int, default=20, help="single calls timed per round and kind")
    p.add_argument("--asserts", type=int, default=8, help="asserts in the code reward's check()")
    p.add_argument("--batch", type=int, default=64, help="completions in the throughput batch")
    p.add_argument("--workers", type=int, default=2, help="reward pool workers")


def _answer(asserts: int) -> dict:
    body = "".join(f"    assert candidate(list(range({i}))) == {sum(range(i))}\n" for i in range(asserts))
    return {"tests": "def check(candidate):\n" + body, "entry_point": "add_all"}


def run(args, log=print) -> dict:
    from trainer import sandbox
    from trainer.rewards.judge import judge
    from trainer.rewards.pool import RewardService
    from trainer.rewards.verifiers import extract_code
    from trainer.sandbox.snippet import run_snippet
    from trainer.tasks.base import Problem

    if args.asserts < 3:
        raise ValueError(f"--asserts {args.asserts}: at least 3 (with fewer, the wrong completion, "
                         "which returns 0, passes: sum(range(0)) == sum(range(1)) == 0)")
    isolations = [i for i in sandbox.ISOLATIONS if sandbox.unavailable(i) is None]
    answer = _answer(args.asserts)
    code = extract_code(SOLUTION, "add_all")
    tests = [answer["tests"]]
    samples: dict[str, dict[str, list[float]]] = {i: {"tool_ms": [], "reward_ms": [],
                                                      "batch_samples_per_s": []} for i in isolations}
    problems = [Problem(f"p{k}", "p", answer, "code") for k in range(args.batch)]
    completions = [WRONG if k % 4 == 0 else SOLUTION for k in range(args.batch)]
    load_before = _loadavg()
    for r in range(args.reps):
        for k in range(args.calls):
            for iso in (isolations if k % 2 == 0 else isolations[::-1]):
                s = samples[iso]
                t = time.monotonic()
                assert run_snippet("print(1 + 1)", timeout_s=10, isolation=iso).output == "2\n"
                s["tool_ms"].append(1e3 * (time.monotonic() - t))
                t = time.monotonic()
                assert judge(code, tests, "add_all", timeout_s=10, isolation=iso).passed
                s["reward_ms"].append(1e3 * (time.monotonic() - t))
        for iso in (isolations if r % 2 == 0 else isolations[::-1]):
            s = samples[iso]
            sandbox.use(iso)   # the pool's workers inherit it
            with RewardService(workers=args.workers, timeout_s=120.0, item_timeout_s=10.0,
                               kinds=["code"]) as pool:
                pool.score_batch(problems[:2], completions[:2])   # workers started and warm
                t = time.monotonic()
                b = pool.score_batch(problems, completions)
                s["batch_samples_per_s"].append(args.batch / (time.monotonic() - t))
            assert sum(b.scores) == args.batch - len(range(0, args.batch, 4)), b
            log(f"round {r + 1} {iso}: tool {statistics.median(s['tool_ms'][-args.calls:]):.1f} ms, "
                f"reward {statistics.median(s['reward_ms'][-args.calls:]):.1f} ms, "
                f"batch {s['batch_samples_per_s'][-1]:.1f} samples/s (load {_loadavg()})")
    result = {"isolations": isolations, "reps": args.reps, "calls": args.calls,
              "asserts": args.asserts, "batch": args.batch, "workers": args.workers,
              "loadavg": [load_before, _loadavg()]}
    for iso, s in samples.items():
        result[iso] = {k: round(statistics.median(v), 2) for k, v in s.items()}
        result[iso].update({f"{k}_min": round(min(v), 2) for k, v in s.items()})
    if "process" in samples and "bwrap" in samples:
        result["ratio"] = {k: round(result["bwrap"][k] / result["process"][k], 3)
                           for k in ("tool_ms", "reward_ms", "batch_samples_per_s")}
        result["batch_ratio_by_round"] = [   # the same round's two batches, a minute apart at most
            round(b / p, 3) for b, p in zip(samples["bwrap"]["batch_samples_per_s"],
                                            samples["process"]["batch_samples_per_s"])]
    return result


def _loadavg() -> float:
    """The machine's 1-minute load average (runnable tasks; this machine's cores: os.cpu_count())."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])
