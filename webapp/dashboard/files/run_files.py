"""Reading a run directory the CLI wrote (`python -m trainer run --out DIR`) for the dashboard's
import (actions/imports.py, which writes what this yields): its config.toml, its JSONL files
(trainer/observe/metrics.py JsonlSink), read line by line, and how the run ended.

Nothing here touches the database. `inspect` reads every file once and refuses a directory with
a RunDirError that names the file and the line; `rows` then yields the run's rows file by file.
A last line cut short (no newline and not JSON: the run was killed while writing it) ends its
file with a warning; anything else unreadable is refused. A CLI run resumed with `--resume`
appended to its files: the steps it trained again after its checkpoint come back, and a `rewind`
row says so, so the importer keeps the later copy (as a dashboard resume rewinds its rows).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from trainer.config import ConfigError
from trainer.run import checkpoint
from trainer.tasks.jsonl import max_data_bytes

CONFIG = "config.toml"
MAX_CONFIG_BYTES = 1 << 20
# what JsonlSink writes, in the order it is imported; metrics and events must be there
KINDS = ("metrics", "histograms", "samples", "timeline", "events")
REQUIRED = ("metrics", "events")
# the trainer's events that end a run (trainer/run/runner.py) and the run status each means
ENDINGS = {"run_finished": "finished", "run_stopped": "stopped", "error": "failed",
           "run_interrupted": "interrupted"}
STARTS = ("run_started", "run_resumed")


class RunDirError(ValueError):
    """A directory that cannot be imported: {file or "directory": what is wrong}."""

    def __init__(self, errors: dict[str, str]):
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))
        self.errors = errors


@dataclass
class Row:
    kind: str            # a KINDS file's row: "points", "histogram", "samples", "timeline", "event";
    step: int            # or "rewind": rows of `name`'s kind from `step` on are replaced
    name: str = ""
    values: dict[str, Any] = field(default_factory=dict)
    time: float | None = None


@dataclass
class Ending:
    status: str                  # finished, stopped, failed or interrupted (no end event)
    step: int
    time: float | None
    summary: dict | None = None  # the trainer's final summary (run_finished / run_stopped)
    error: str | None = None


@dataclass
class RunDir:
    path: Path
    config_text: str
    fingerprint: str
    ending: Ending
    max_steps: int | None        # from the last start event (a resume may change it)
    started: float | None        # the first start event's time
    last_step: int               # the last metrics line's step
    lines: dict[str, int]        # rows per file
    warnings: list[str]
    checkpoints: list[Path]


class JsonlFile:
    """The objects of one JSONL file, streamed with their line numbers. After iterating,
    `truncated` is the number of a last line that was cut short (skipped), else None."""

    def __init__(self, path: Path, limit: int):
        self.path, self.limit, self.truncated = path, limit, None

    def __iter__(self) -> Iterator[tuple[int, dict]]:
        name, read = self.path.name, 0
        pending: tuple[int, bytes] | None = None   # one line of look-ahead: is it the last?
        with self.path.open("rb") as f:
            for lineno, raw in enumerate(f, start=1):
                read += len(raw)
                if read > self.limit:   # the file grew after its size was checked
                    raise RunDirError({name: f"grew past {self.limit} bytes while being read "
                                             "(RLPILOT_MAX_DATA_BYTES)"})
                if pending is not None:
                    yield pending[0], _parse(name, *pending)
                pending = (lineno, raw) if raw.strip() else None
        if pending is None:
            return
        lineno, raw = pending
        if not raw.endswith(b"\n"):
            try:
                json.loads(raw)
            except ValueError:   # UnicodeDecodeError too: cut inside a character
                self.truncated = lineno
                return
        yield lineno, _parse(name, lineno, raw)


def _parse(name: str, lineno: int, raw: bytes) -> dict:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise RunDirError({name: f"line {lineno}: not valid UTF-8"}) from None
    except json.JSONDecodeError as e:
        raise RunDirError({name: f"line {lineno}: invalid JSON ({e.msg} at column {e.colno})"}) from None
    problem = None
    if not isinstance(obj, dict):
        problem = "expected a JSON object"
    elif not _is_int(obj.get("step")) or obj["step"] < 0:
        problem = 'no "step" (a whole number >= 0)'
    elif name == "histograms.jsonl" and not (isinstance(obj.get("name"), str) and obj["name"]
                                             and isinstance(obj.get("edges"), list)
                                             and isinstance(obj.get("counts"), list)):
        problem = 'a histogram needs "name", "edges" and "counts"'
    elif name == "events.jsonl" and not (isinstance(obj.get("kind"), str) and obj["kind"]):
        problem = 'an event needs a "kind"'
    elif name == "timeline.jsonl" and not isinstance(obj.get("spans"), list):
        problem = 'a timeline row needs "spans" (a list)'
    if problem:
        raise RunDirError({name: f"line {lineno}: {problem}"})
    return obj


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _time(obj: dict) -> float | None:
    t = obj.get("time")
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None


def _file(directory: Path, kind: str) -> Path:
    return directory / f"{kind}.jsonl"


def _open(directory: Path, kind: str, limit: int) -> JsonlFile | None:
    path = _file(directory, kind)
    if not path.exists():
        if kind in REQUIRED:
            raise RunDirError({path.name: "missing: not a run directory the CLI wrote"})
        return None
    if path.is_symlink() or not path.is_file():
        raise RunDirError({path.name: "not a regular file"})
    size = path.stat().st_size
    if size > limit:
        raise RunDirError({path.name: f"{size} bytes is more than the {limit} a data file may "
                                      "have (RLPILOT_MAX_DATA_BYTES)"})
    return JsonlFile(path, limit)


def _first_line(path: Path) -> bytes:
    if not path.is_file():
        return b""
    with path.open("rb") as f:
        return f.readline(1 << 20).strip()


def inspect(directory: str | Path) -> RunDir:
    """Read the run directory once and say what it holds, or raise RunDirError."""
    d = Path(directory)
    if not d.is_dir():
        raise RunDirError({"directory": f"{d} is not a directory"})
    config = d / CONFIG
    if not config.is_file():
        raise RunDirError({CONFIG: f"missing: {d} is not a run directory the CLI wrote"})
    if config.stat().st_size > MAX_CONFIG_BYTES:
        raise RunDirError({CONFIG: f"larger than {MAX_CONFIG_BYTES} bytes"})
    try:
        config_bytes = config.read_bytes()
        config_text = config_bytes.decode("utf-8")
    except UnicodeDecodeError:
        raise RunDirError({CONFIG: "not valid UTF-8"}) from None
    try:
        limit = max_data_bytes()
    except ConfigError as e:
        raise RunDirError(e.errors) from None
    files = {kind: _open(d, kind, limit) for kind in KINDS}
    # the run's identity: its config and its first lines (the first event holds the start time)
    digest = hashlib.sha256(config_bytes)
    for kind in ("metrics", "events"):
        digest.update(b"\0" + _first_line(_file(d, kind)))
    lines, warnings = {}, []
    last_step, max_steps, started, last_time = 0, None, None, None
    end: tuple[str, dict] | None = None   # the last ending event, and after it no start
    for kind, jf in files.items():
        n = 0
        for _, obj in jf or ():
            n += 1
            t = _time(obj)
            if t is not None:
                last_time = t if last_time is None else max(last_time, t)
            if kind == "metrics":
                last_step = obj["step"]
            elif kind == "events":
                if obj["kind"] in STARTS:
                    end = None
                    started = t if started is None else started
                    if _is_int(obj.get("max_steps")):
                        max_steps = obj["max_steps"]
                elif obj["kind"] in ENDINGS:
                    end = (obj["kind"], obj)
        lines[kind] = n
        if jf is not None and jf.truncated is not None:
            warnings.append(f"{jf.path.name} line {jf.truncated} was cut short (the run was "
                            f"killed while writing it): imported up to line {jf.truncated - 1}")
    if end is None:
        ending = Ending("interrupted", last_step, last_time, error=(
            "the run directory records no end (run_finished, run_stopped or error): the CLI run "
            "was killed, or was still running when it was imported"))
    else:
        kind, obj = end
        data = _event_data(obj)
        if kind in ("error", "run_interrupted"):
            ending = Ending(ENDINGS[kind], obj["step"], _time(obj) or last_time,
                            error=str(data.get("message") or "the run failed")[:2000])
        else:
            ending = Ending(ENDINGS[kind], obj["step"], _time(obj) or last_time, summary=data)
    return RunDir(path=d, config_text=config_text, fingerprint="sha256:" + digest.hexdigest(),
                  ending=ending, max_steps=max_steps, started=started, last_step=last_step,
                  lines=lines, warnings=warnings, checkpoints=checkpoint.list_checkpoints(d))


def _event_data(obj: dict) -> dict:
    return {k: v for k, v in obj.items() if k not in ("step", "time", "kind")}


def rows(run_dir: RunDir) -> Iterator[Row]:
    """The run's rows, file by file in KINDS order (a step's samples as one row, as the
    trainer's sink hands them over), with `rewind` rows where a resumed run trained steps again.
    Raises RunDirError if a file changed since `inspect` and no longer reads."""
    limit = max_data_bytes()
    for kind in KINDS:
        jf = _open(run_dir.path, kind, limit)
        if jf is not None:
            yield from _KIND_ROWS[kind](jf)


def _again(step: int, key: Any, last: int, seen: set) -> bool:
    """Whether a row of (`step`, `key`) comes again after the rows so far (last step `last`,
    `seen` keys at it): a resumed run training the steps after its checkpoint again."""
    return step < last or (step == last and key in seen)


def _metrics_rows(jf: JsonlFile) -> Iterator[Row]:
    last = -1
    for _, obj in jf:
        step = obj["step"]
        if step <= last:
            yield Row("rewind", step, "points")
        last = step
        yield Row("points", step, values={k: v for k, v in obj.items() if k not in ("step", "time")})


def _histogram_rows(jf: JsonlFile) -> Iterator[Row]:
    last, seen = -1, set()
    for _, obj in jf:
        step = obj["step"]
        if _again(step, obj["name"], last, seen):
            yield Row("rewind", step, "histogram")
            seen = set()
        if step != last:
            last, seen = step, set()
        seen.add(obj["name"])
        yield Row("histogram", step, obj["name"], {"edges": obj["edges"], "counts": obj["counts"]})


def _sample_rows(jf: JsonlFile) -> Iterator[Row]:
    last, seen, batch = -1, set(), []
    for _, obj in jf:
        step, key = obj["step"], (obj.get("group"), obj.get("index"))
        again = _again(step, key, last, seen)
        if batch and (again or step != last):
            yield Row("samples", last, values={"rows": batch})
            batch = []
        if again:
            yield Row("rewind", step, "samples")
        if again or step != last:
            last, seen = step, set()
        seen.add(key)
        batch.append({k: v for k, v in obj.items() if k != "step"})
    if batch:
        yield Row("samples", last, values={"rows": batch})


def _timeline_rows(jf: JsonlFile) -> Iterator[Row]:
    last = -1
    for _, obj in jf:
        step = obj["step"]
        # a step may have several rows (a checkpoint's spans come after the step's): only a step
        # going back is a resume (the step a killed run was in may so keep a row of each attempt)
        if step < last:
            yield Row("rewind", step, "timeline")
        last = step
        yield Row("timeline", step, values={"spans": obj["spans"]})


def _event_rows(jf: JsonlFile) -> Iterator[Row]:
    for _, obj in jf:   # a log: every event stays, as a dashboard resume keeps them
        yield Row("event", obj["step"], obj["kind"], _event_data(obj), _time(obj))


_KIND_ROWS = {"metrics": _metrics_rows, "histograms": _histogram_rows, "samples": _sample_rows,
              "timeline": _timeline_rows, "events": _event_rows}
