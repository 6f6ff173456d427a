"""`python -m trainer check RUN [--json]`: audit a run's invariants from its files
(trainer/invariants/audit.py): each rule with the run's own count and the recheck of its
recorded samples; exit status 1 when any rule was broken, 2 when the run cannot be read."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from trainer.accounting.run_files import RunDirError, read_run
from trainer.invariants.audit import RECHECKED, audit
from trainer.invariants.probe import RULE as PROBE_RULE
from trainer.observe.metrics import read_jsonl
from trainer.run.invariant_watch import bounds


def read_audit(run_dir: str | Path) -> list:
    """The rules' reports of run directory `run_dir`."""
    d = Path(run_dir)
    if not d.is_dir():
        raise RunDirError(f"{d}: not a run directory (python -m trainer check reads a run's folder)")
    cfg, rows = read_run(d)
    samples_path = d / "samples.jsonl"
    try:
        samples = read_jsonl(samples_path) if samples_path.is_file() else []
    except ValueError as e:
        raise RunDirError(str(e)) from None
    return audit(rows, samples, cfg.async_.enabled, bounds(cfg, 0).max_age)


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:10])) + (f" and {len(steps) - 10} more" if len(steps) > 10 else "")


def text(reports: list) -> str:
    out = [f"{'rule':<20}{'run':>4}{'recheck':>9}  where"]
    for r in reports:
        run = "-" if r.recorded is None else str(r.recorded)
        again = "-" if r.rechecked is None else str(r.rechecked)
        where = []
        if r.recorded_steps:
            where.append(f"steps {_steps(r.recorded_steps)}")
        if r.samples:
            where.append("samples " + ", ".join(r.samples[:5]))
        if r.rule == "env_loss":
            where.append("(a recorded sample shows no loss weight: the run's own count)")
        elif r.rule == PROBE_RULE:
            where.append("(the run's own probe after each weight sync: generators on other weights)")
        elif r.rule not in RECHECKED:
            where.append("(the run's own data accounting)")
        out.append(f"{r.rule:<20}{run:>4}{again:>9}  {'; '.join(where)}".rstrip())
    broken = [r.rule for r in reports if r.broken]
    unchecked = all(r.recorded is None for r in reports)
    if broken:
        out.append("broken: " + ", ".join(broken))
    else:
        out.append("all held" + (" (the run recorded no invariants/* figures: recorded samples "
                                 "rechecked only)" if unchecked else ""))
    return "\n".join(out)


def _cmd_check(args) -> int:
    try:
        reports = read_audit(args.run_dir)
    except RunDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([vars(r) | {"broken": r.broken} for r in reports], indent=2))
    else:
        print(text(reports))
    return 1 if any(r.broken for r in reports) else 0


def add_parser(sub) -> None:
    s = sub.add_parser("check", help="audit a run's invariants from its files (docs/invariants.md)")
    s.add_argument("run_dir", metavar="RUN", help="a run directory")
    s.add_argument("--json", action="store_true", help="the rules' reports as JSON")
    s.set_defaults(func=_cmd_check)
