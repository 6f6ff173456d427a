"""Benchmarks: `python -m trainer bench NAME [--json [OUT]]`.

Each benchmark runs its variants side by side in one process, on the same task, model and
seed, and prints both and their ratios. Tests never assert timings; these do the measuring.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub) -> None:
    from trainer.bench import (
        agents,
        april,
        asynchronous,
        engine,
        estimate,
        greso,
        invariants,
        learn,
        mismatch,
        pilot,
        samples,
        sandbox,
        scale,
    )

    b = sub.add_parser("bench", help="benchmarks (see `bench -h`)")
    bsub = b.add_subparsers(dest="bench", required=True)
    for module in (learn, april, greso, asynchronous, engine, samples, scale, pilot, mismatch, estimate,
                   sandbox, invariants, agents):
        p = bsub.add_parser(module.NAME, help=module.HELP, description=module.__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--json", nargs="?", const=True, default=False, metavar="OUT",
                       help="print only the JSON result; with OUT, print the progress as usual "
                       "and write the JSON result to the file OUT instead")
        module.add_arguments(p)
        p.set_defaults(func=lambda args, m=module: _run(m, args))


def _run(module, args) -> int:
    quiet = args.json is True
    log = (lambda *a, **k: None) if quiet else print
    result = module.run(args, log=log)
    if isinstance(args.json, str):
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    else:
        print(json.dumps(result, indent=None if quiet else 2))
    return 0
