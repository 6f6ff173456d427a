"""Benchmarks: `python -m trainer bench NAME [--json]`.

Each benchmark runs its variants side by side in one process, on the same task, model and
seed, and prints both and their ratios. Tests never assert timings; these do the measuring.
"""
from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    from trainer.bench import april, asynchronous, engine, greso, learn, pilot, samples, scale

    b = sub.add_parser("bench", help="benchmarks (see `bench -h`)")
    bsub = b.add_subparsers(dest="bench", required=True)
    for module in (learn, april, greso, asynchronous, engine, samples, scale, pilot):
        p = bsub.add_parser(module.NAME, help=module.HELP, description=module.__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--json", action="store_true", help="print only the JSON result")
        module.add_arguments(p)
        p.set_defaults(func=lambda args, m=module: _run(m, args))


def _run(module, args) -> int:
    log = (lambda *a, **k: None) if args.json else print
    result = module.run(args, log=log)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
