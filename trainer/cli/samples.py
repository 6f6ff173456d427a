"""`python -m trainer samples RUN_DIR`: what the model wrote, from a run's samples.jsonl.

    python -m trainer samples runs/april-1 --step 12        the samples recorded at step 12
    python -m trainer samples runs/april-1 --worst -n 5     the five with the lowest reward
    python -m trainer samples runs/april-1 --longest        the longest first
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def load(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "samples.jsonl"
    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory")
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no samples.jsonl (a run with run.log_samples = 0, "
                                "or one from before the rollout inspector)")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:   # a run killed mid-write leaves half a line
                    print(f"warning: {path}:{n}: skipped ({e.msg})", file=sys.stderr)
    return rows


def select(rows: list[dict], step: int | None = None, order: str = "step", limit: int = 20) -> list[dict]:
    if step is not None:
        rows = [r for r in rows if r.get("step") == step]
    if order == "worst":    # lowest reward first; a failed reward (None) counts lowest
        rows = sorted(rows, key=lambda r: (r.get("reward") is not None, r.get("reward") or 0.0,
                                           -r.get("length", 0)))
    elif order == "longest":
        rows = sorted(rows, key=lambda r: -r.get("length", 0))
    return rows[:limit] if limit else rows


def _num(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v) if isinstance(v, (int, float)) else str(v)


def describe(r: dict) -> str:
    versions = " ".join(f"{'env' if v == -1 else f'v{v}'}x{n}" for v, n in r.get("segments", []))
    head = (f"step {r.get('step')}  group {r.get('group')} #{r.get('index')}  len {r.get('length')}  "
            f"reward {_num(r.get('reward'))} (score {_num(r.get('score'))})  "
            f"adv {_num(r.get('advantage'), '{:+.2f}')}  {r.get('finish')}  [{versions}]  "
            f"staleness {r.get('staleness', 0)}  ({r.get('why')})")
    if r.get("reward_status", "ok") != "ok":
        head += f"\n  reward {r['reward_status']}: {r.get('reward_error', '')}"
    body = f"{head}\n  prompt:\n{_indent(r.get('prompt', ''))}\n"
    if r.get("turns") and r.get("tokens"):
        return body + _episode(r)
    return body + f"  completion:\n{_indent(r.get('completion', ''))}"


def _episode(r: dict) -> str:
    """An episode's completion turn by turn (the environment's messages are never trained)."""
    ep = r.get("episode") or {}
    lines = [f"  episode: {_count(ep.get('turns'), 'turn')}, {_count(ep.get('tool_calls'), 'tool call')} "
             f"({ep.get('tool_errors')} failed, {_num(ep.get('tool_s'), '{:.3f}')} s), "
             f"ended: {ep.get('end') or '-'}"]
    n = 0
    for t in r["turns"]:
        text = "".join(r["tokens"][t["start"]:t["end"]])
        n += t["role"] == "model"
        label = f"model turn {n}" if t["role"] == "model" else "tool message (environment, not trained)"
        lines.append(f"  [{label}]\n{_indent(text)}")
    return "\n".join(lines)


def _count(n, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _indent(text) -> str:
    return "\n".join("    " + line for line in str(text).splitlines() or [""])


def _cmd_samples(args) -> int:
    order = "worst" if args.worst else "longest" if args.longest else "step"
    picked = select(load(args.run_dir), args.step, order, args.limit)
    if args.json:
        print(json.dumps(picked, indent=1))
        return 0
    if not picked:
        print("no samples" + (f" at step {args.step}" if args.step is not None else ""))
    for r in picked:
        print(describe(r) + "\n")
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("samples", help="print the samples a run recorded (the rollout inspector)")
    s.add_argument("run_dir")
    s.add_argument("--step", type=int, help="only the samples of this step")
    way = s.add_mutually_exclusive_group()
    way.add_argument("--worst", action="store_true", help="lowest reward first")
    way.add_argument("--longest", action="store_true", help="longest first")
    s.add_argument("-n", "--limit", type=int, default=20, help="at most this many (0 = all)")
    s.add_argument("--json", action="store_true", help="the rows as JSON")
    s.set_defaults(func=_cmd_samples)
