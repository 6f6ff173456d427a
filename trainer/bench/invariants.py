"""bench invariants: what checking a run's invariants costs a step (docs/invariants.md).

Trains each preset of `--presets` for `--steps` steps twice per round, with run.check_invariants
off and on, the order alternating from round to round (interleaved, so a machine that slows
down part-way weighs on both), and reports per preset: the median step time of each (the
first step of each run left out: it warms up), their ratio, and the checks' own time per step
(`timing/invariants_s`, measured around them; the weight probe after each sync included, and
its own `timing/probe_s` reported apart) as a share of the median step. The share is the
figure to read on a shared machine: the two runs' step times differ by more than the checks
whenever another job takes the cores.
"""
from __future__ import annotations

import statistics
import tempfile

from trainer import config as config_mod
from trainer.observe.metrics import MemorySink

NAME = "invariants"
HELP = "what the per-step invariant checks cost: step time with checking on vs off"


def add_arguments(p) -> None:
    p.add_argument("--presets", default="demo,all", help="comma-separated presets")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")


def _steps(preset: str, check: bool, args) -> MemorySink:
    from trainer.run.runner import Runner

    cfg = config_mod.load(preset, [*args.set, f"run.max_steps={args.steps}", f"run.seed={args.seed}",
                                   "run.eval_every=0", "run.checkpoint_every=0",
                                   f"run.check_invariants={str(check).lower()}"])
    sink = MemorySink()
    with tempfile.TemporaryDirectory(prefix="rlpilot-bench-") as d:
        with Runner(cfg, d, sink=sink, system_telemetry=False) as runner:
            runner.run()
    return sink


def run(args, log=print) -> dict:
    out = {"steps": args.steps, "rounds": args.rounds, "presets": {}}
    for preset in [p.strip() for p in args.presets.split(",") if p.strip()]:
        step_s: dict[bool, list[float]] = {False: [], True: []}
        check_s: list[float] = []
        probe_s: list[float] = []
        for r in range(args.rounds):
            for check in ((False, True) if r % 2 == 0 else (True, False)):
                sink = _steps(preset, check, args)
                step_s[check] += sink.series("timing/step_s")[1:]
                if check:
                    check_s += sink.series("timing/invariants_s")[1:]
                    probe_s += sink.series("timing/probe_s")[1:]
                checks = sink.series("timing/invariants_s")[1:]
                log(f"{preset} round {r + 1} checks {'on' if check else 'off'}: median step "
                    f"{statistics.median(sink.series('timing/step_s')[1:]):.3f} s"
                    + (f", checks {1000 * statistics.median(checks):.2f} ms a step" if checks else ""))
        off, on = statistics.median(step_s[False]), statistics.median(step_s[True])
        check = statistics.median(check_s)
        out["presets"][preset] = {
            "step_s_median_off": round(off, 4), "step_s_median_on": round(on, 4),
            "on_over_off": round(on / off, 4), "check_s_median": round(check, 6),
            "check_s_max": round(max(check_s), 6), "check_share_of_step": round(check / on, 5),
            **({"probe_s_median": round(statistics.median(probe_s), 6),
                "probe_share_of_step": round(statistics.median(probe_s) / on, 5)}
               if probe_s else {})}
        log(f"{preset}: " + ", ".join(f"{k}={v}" for k, v in out["presets"][preset].items()))
    return out
