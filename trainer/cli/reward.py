"""`rlpilot reward`: score a file of completions against a JSONL dataset, offline.

    python -m trainer reward --dataset D.jsonl --completions C.jsonl [--task math|code]
                             [--workers N] [--timeout S] [--details]

The dataset is a math or code JSONL file as used by data.path (see trainer.tasks.jsonl). Each
line of the completions file names a problem by its id or by its 0-based row in the dataset
(blank lines are not rows), and several lines may name the same problem:

    {"id": "p17", "completion": "... \\boxed{3}"}
    {"index": 16, "completion": "..."}

Prints one JSON object: {"n", "mean_reward", "accuracy", "errors", "timeouts", "unknown_ids"},
plus "items" (one per scored completion) with --details. Exit code 0 on success, 2 on bad
input (a missing file, a line that is not valid JSON, a completion naming an unknown problem);
unknown problems are listed in "unknown_ids" and the others are still scored.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from trainer.config import ConfigError

EXIT_BAD_INPUT = 2
_BATCH_PER_WORKER = 16


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `reward` subcommand on an argparse subparsers object."""
    p = subparsers.add_parser(
        "reward", help="score completions against a math or code JSONL dataset",
        description="Score a JSONL file of completions against a math or code JSONL dataset "
                    "with the trainer's reward functions and print a JSON summary.")
    p.add_argument("--dataset", required=True, metavar="D.jsonl",
                   help="problems: {prompt, answer} (math) or {prompt, tests, entry_point} (code)")
    p.add_argument("--completions", required=True, metavar="C.jsonl",
                   help='one {"id": ..., "completion": ...} or {"index": row, "completion": ...} '
                        "per line")
    p.add_argument("--task", choices=["math", "code"], default=None,
                   help="dataset kind (default: code if its rows have 'tests', else math)")
    p.add_argument("--workers", type=int, default=None,
                   help="reward processes (0 = score in this process; default: up to 4, one "
                        "per CPU)")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds allowed to score one completion (default: 10)")
    p.add_argument("--details", action="store_true",
                   help="also list every scored completion with its score and status")
    p.set_defaults(func=run)
    return p


class _BadInput(Exception):
    pass


def run(args: argparse.Namespace) -> int:
    """Run `rlpilot reward`; returns the exit code."""
    try:
        return _run(args)
    except _BadInput as e:
        _err(str(e))
        return EXIT_BAD_INPUT


def _err(msg: str) -> None:
    print(f"rlpilot reward: error: {msg}", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    from trainer.rewards.pool import RewardService
    from trainer.tasks.jsonl import JsonlTask

    workers = getattr(args, "workers", None)
    if workers is None:
        workers = max(1, min(4, os.cpu_count() or 1))
    if isinstance(workers, bool) or not isinstance(workers, int) or not 0 <= workers <= 64:
        raise _BadInput(f"--workers must be an integer in [0, 64], got {workers!r}")
    timeout = getattr(args, "timeout", 10.0)
    if timeout is None:
        timeout = 10.0
    if not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        raise _BadInput(f"--timeout must be a positive number of seconds, got {timeout!r}")
    details = bool(getattr(args, "details", False))

    dataset = str(args.dataset)
    kind = getattr(args, "task", None) or _infer_kind(dataset)
    if kind not in ("math", "code"):
        raise _BadInput(f"--task must be 'math' or 'code', got {kind!r}")
    try:
        task = JsonlTask(dataset, kind=kind)
    except ConfigError as e:
        raise _BadInput("dataset: " + "; ".join(e.errors.values())) from None

    entries = _read_completions(str(args.completions))
    rows: list[int] = []
    lines: list[int] = []
    texts: list[str] = []
    unknown: list[Any] = []   # as given: ids (strings) and row indices (integers)
    seen_unknown: set = set()
    for lineno, ref, completion in entries:
        row = _resolve(task, ref)
        if row is None:
            if ref not in seen_unknown:
                seen_unknown.add(ref)
                unknown.append(ref[1])
            continue
        rows.append(row)
        lines.append(lineno)
        texts.append(completion)

    problems = [task.problem(r) for r in rows]
    scores: list[float] = []
    statuses: list[str] = []
    notes: list[str] = []
    errors = timeouts = 0
    if problems:
        step = _BATCH_PER_WORKER * max(1, workers)
        per_worker = -(-step // max(1, workers))
        batch_timeout = timeout * per_worker + 5.0   # a backstop: each item has its own limit
        with RewardService(workers=workers, timeout_s=batch_timeout, item_timeout_s=timeout,
                           kinds=(kind,)) as service:
            for start in range(0, len(problems), step):
                b = service.score_batch(problems[start:start + step], texts[start:start + step])
                scores += b.scores
                statuses += b.statuses
                notes += b.notes
                errors += b.errors
                timeouts += b.timeouts

    n = len(scores)
    result: dict[str, Any] = {
        "n": n,
        "mean_reward": (sum(scores) / n) if n else None,
        "accuracy": (sum(s >= 1.0 for s in scores) / n) if n else None,
        "errors": errors,
        "timeouts": timeouts,
        "unknown_ids": unknown,
    }
    if details:
        result["items"] = [
            {"line": ln, "id": p.id, "index": r, "score": s, "status": st,
             **({"note": note} if note else {})}
            for ln, p, r, s, st, note in zip(lines, problems, rows, scores, statuses, notes)]
    print(json.dumps(result, ensure_ascii=False))
    if unknown:
        shown = ", ".join(json.dumps(u) for u in unknown[:10])
        more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
        _err(f"{args.completions}: {len(unknown)} completion problem reference(s) match no "
             f"problem in {dataset}: {shown}{more}")
        return EXIT_BAD_INPUT
    return 0


def _infer_kind(path: str) -> str:
    """'code' when the dataset's first row has 'tests', else 'math' (errors surface later)."""
    try:
        with open(path, "rb") as f:
            for raw in f:
                if raw.strip():
                    try:
                        obj = json.loads(raw.decode("utf-8-sig"))
                    except (ValueError, UnicodeDecodeError):
                        return "math"
                    return "code" if isinstance(obj, dict) and "tests" in obj else "math"
    except OSError:
        pass
    return "math"


def _read_completions(path: str) -> list[tuple[int, tuple[str, Any], str]]:
    """[(line number, ("id", id) or ("index", row), completion)]."""
    p = Path(path)
    if not p.is_file():
        raise _BadInput(f"completions file {path}: " +
                        ("not a regular file" if p.exists() else "file not found"))
    try:
        raw_lines = p.read_bytes().splitlines()
    except OSError as e:
        raise _BadInput(f"completions file {path}: cannot read: {e.strerror or e}") from None
    out = []
    for lineno, raw in enumerate(raw_lines, start=1):
        if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        if not raw.strip():
            continue
        where = f"{path}, line {lineno}"
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise _BadInput(f"{where}: not valid UTF-8") from None
        except json.JSONDecodeError as e:
            raise _BadInput(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise _BadInput(f"{where}: expected a JSON object")
        if "completion" not in obj:
            raise _BadInput(f"{where}: missing 'completion'")
        if not isinstance(obj["completion"], str):
            raise _BadInput(f"{where}: 'completion' must be a string")
        has_id, has_index = obj.get("id") is not None, obj.get("index") is not None
        if has_id == has_index:
            raise _BadInput(f"{where}: give exactly one of 'id' and 'index'")
        if has_id:
            pid = obj["id"]
            if isinstance(pid, bool) or not isinstance(pid, (str, int)):
                raise _BadInput(f"{where}: 'id' must be a string or an integer")
            ref = ("id", str(pid))
        else:
            idx = obj["index"]
            if isinstance(idx, bool) or not isinstance(idx, int):
                raise _BadInput(f"{where}: 'index' must be an integer (a 0-based dataset row)")
            ref = ("index", idx)
        out.append((lineno, ref, obj["completion"]))
    if not out:
        raise _BadInput(f"completions file {path}: no completions in the file")
    return out


def _resolve(task, ref: tuple[str, Any]) -> int | None:
    how, value = ref
    if how == "index":
        return value if 0 <= value < task.train_size else None
    try:
        return task.index_of(value)
    except KeyError:
        return None
