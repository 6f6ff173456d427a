"""Importing a run directory the CLI wrote (`python -m trainer run --out DIR`) as a dashboard run
owned by the importer (`manage.py import_run`, the runs page's upload).

The directory is read once to refuse what cannot be imported before anything is written
(run_files.inspect: the file and line at fault) and its config goes through the launch form's
checks (build_config, validation.config_problems, policy.model_source_problem). The run is then
written the way a live run is: its row starts running, its files' rows go through the same
append() the trainer's database sink uses (one transaction per few thousand rows, bulk inserts),
and it ends through end_run() with the trainer's final summary (the run_finished / run_stopped
event's data, what Runner.summary() gave it). Its checkpoints are hard-linked (copied across
file systems) into the run's own folder, so a resume from the dashboard trains from them like
any run's. `Run.imported_from` holds the directory's fingerprint (its config.toml and first
lines): the same directory imported twice is refused, naming the first import.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import datetime
from datetime import timezone as dt_timezone
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from webapp.dashboard import lifecycle
from webapp.dashboard.access import policy, validation
from webapp.dashboard.actions.launch import build_config, run_dir
from webapp.dashboard.actions.rows import Record, append, set_status, status_record
from webapp.dashboard.actions.runs import end_run
from webapp.dashboard.errors import Conflict, Invalid
from webapp.dashboard.files import archives, run_files
from webapp.dashboard.models import HistogramSnapshot, MetricPoint, RolloutSample, Run, TimelineSlice

# rows (metric values, samples, histograms ...) per transaction: big enough for bulk inserts to
# pay, small enough that a live run's sink never waits long for the run's row lock
BATCH_ROWS = 5000
# what a `rewind` row (a resumed CLI run's steps trained again) replaces
REWOUND = {"points": MetricPoint, "histogram": HistogramSnapshot, "samples": RolloutSample,
           "timeline": TimelineSlice}


@dataclass
class Imported:
    run: Run
    warnings: list[str] = field(default_factory=list)


def import_run_dir(user, directory: str | Path, name: str | None = None, *,
                   source: str | None = None) -> Imported:
    """Import the CLI run directory `directory` as a run owned by `user` (named `name`, default:
    the directory's name; `source`: what the `imported` event says it came from, default the
    directory). Raises Invalid (what is wrong with the directory or its config) or Conflict
    (already imported)."""
    try:
        info = run_files.inspect(directory)
    except run_files.RunDirError as e:
        raise Invalid(f"not imported: {e}", e.errors) from None
    first = Run.objects.filter(imported_from=info.fingerprint).values_list("pk", flat=True).first()
    if first is not None:
        raise Conflict(f"already imported as run #{first}")
    cfg = _config(user, info)
    name = name if name is not None else Path(directory).resolve().name
    problem = validation.check_name(name)
    if problem:
        raise Invalid(f"not imported: name: {problem}", {"name": problem})
    # the checkpoints first, into a folder of the runs folder: a copy across file systems may
    # take long, and a running run's row must not wait on it (the stale-run sweep would take it
    # for a lost worker's)
    settings.RUNS_DIR.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".import-", dir=settings.RUNS_DIR))
    try:
        link_checkpoints(info.checkpoints, staging / "checkpoints")
        return _import(user, info, cfg, name, source or str(Path(directory).resolve()),
                       staging / "checkpoints")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _import(user, info: run_files.RunDir, cfg, name: str, source: str, checkpoints: Path) -> Imported:
    """The run's row, its checkpoints (moved from `checkpoints`), its rows and its end."""
    try:
        with transaction.atomic():
            run = Run.objects.create(
                owner=user, name=name.strip(), config=cfg.to_dict(), knobs=cfg.knob_values(),
                max_steps=info.max_steps or cfg.run.max_steps, status=lifecycle.QUEUED,
                desired=lifecycle.RUN, queue=settings.RLPILOT_QUEUES[0], heartbeat_at=timezone.now(),
                started_at=_when(info.started) or timezone.now(), imported_from=info.fingerprint)
            append(run.pk, [status_record(lifecycle.RUNNING, 0, at=info.started)], ring_bell=False)
    except IntegrityError:   # the same directory imported at the same moment
        first = Run.objects.filter(imported_from=info.fingerprint).values_list("pk", flat=True).first()
        raise Conflict(f"already imported as run #{first}") from None
    try:
        directory = run_dir(run.pk)
        directory.mkdir(parents=True, exist_ok=True)
        # a leftover folder of this id (a row never committed) holds nothing of any run's: only
        # the imported checkpoints may be there, or a resume would pick another
        shutil.rmtree(directory / "checkpoints", ignore_errors=True)
        os.replace(checkpoints, directory / "checkpoints")
        _write_rows(run.pk, info)
        _end(run.pk, info, user, source)
    except BaseException:   # nothing half-imported stays behind
        Run.objects.filter(pk=run.pk).delete()
        shutil.rmtree(run_dir(run.pk), ignore_errors=True)
        raise
    run.refresh_from_db()
    return Imported(run, list(info.warnings))


def import_archive(user, upload, size: int | None, filename: str = "", name: str | None = None) -> Imported:
    """Import a run directory uploaded as an archive (.zip or .tar.gz; `upload` a binary file,
    `size` its length when known), unpacked safely (files/archives.py) into a folder of RLPILOT_RUNS_DIR
    (so its checkpoints are hard-linked, not copied) that goes once it is imported."""
    limit = settings.MAX_IMPORT_BYTES
    too_big = f"larger than the {limit} bytes an upload may have (RLPILOT_MAX_IMPORT_BYTES)"
    if size is not None and size > limit:
        raise Invalid(f"not imported: {filename}: {too_big}", {"archive": too_big})
    settings.RUNS_DIR.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".import-", dir=settings.RUNS_DIR))
    try:
        archive, unpacked = work / "archive", work / "run"
        with open(archive, "wb") as out:
            read = 0
            while chunk := upload.read(1 << 20):
                read += len(chunk)
                if read > limit:
                    raise Invalid(f"not imported: {filename}: {too_big}", {"archive": too_big})
                out.write(chunk)
        unpacked.mkdir()
        try:
            directory = archives.extract(archive, unpacked, max_bytes=limit,
                                         max_files=settings.MAX_IMPORT_FILES)
        except archives.ArchiveError as e:
            raise Invalid(f"not imported: {filename}: {e}", {"archive": str(e)}) from None
        default = directory.name if directory != unpacked else _stem(filename)
        return import_run_dir(user, directory, name or default or "imported run",
                              source=f"upload {filename}".strip())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _stem(filename: str) -> str:
    base = Path(filename or "").name
    for suffix in (".tar.gz", ".tgz", ".zip", ".tar"):
        if base.lower().endswith(suffix):
            return base[:-len(suffix)]
    return base


def _config(user, info: run_files.RunDir):
    """The directory's config.toml through the launch form's checks, or Invalid naming them."""
    try:
        cfg = build_config(None, {}, toml=info.config_text)
        errors = validation.config_problems(cfg)
    except Invalid as e:
        errors = e.errors
    else:
        if "model.path" not in errors:
            problem = policy.model_source_problem(user, cfg.model.path)
            if problem:
                errors["model.path"] = problem
    if errors:
        errors = validation.clip_errors(errors)
        raise Invalid(f"not imported: {run_files.CONFIG}: " + "; ".join(f"{k}: {v}" for k, v in errors.items()),
                      {f"{run_files.CONFIG} {k}": v for k, v in errors.items()})
    return cfg


def _when(t: float | None) -> datetime | None:
    return None if t is None else datetime.fromtimestamp(t, dt_timezone.utc)


def _link_or_copy(src, dst) -> None:
    try:   # checkpoints are never changed in place (a new one is a new folder): sharing is safe
        os.link(src, dst)
    except OSError:   # another file system, or links not allowed
        shutil.copy2(src, dst)


def link_checkpoints(checkpoints: list[Path], folder: Path) -> None:
    """The checkpoints (step_N folders) into `folder`, hard-linked where possible."""
    folder.mkdir(parents=True, exist_ok=True)
    for ck in checkpoints:
        shutil.copytree(ck, folder / ck.name, copy_function=_link_or_copy)


def _weight(r: run_files.Row) -> int:
    if r.kind == "points":
        return len(r.values)
    if r.kind == "samples":
        return len(r.values.get("rows") or ())
    return 1


def _write_rows(rid: int, info: run_files.RunDir) -> None:
    pending: list[Record] = []
    weight = 0

    def flush() -> None:
        nonlocal pending, weight
        if pending:   # the heartbeat: a long import is no lost worker to the stale-run sweep
            append(rid, pending, {"heartbeat_at": timezone.now()}, ring_bell=False)
        pending, weight = [], 0

    try:
        for row in run_files.rows(info):
            if row.kind == "rewind":   # a resumed CLI run trained these steps again
                flush()
                REWOUND[row.name].objects.filter(run_id=rid, step__gte=row.step).delete()
                continue
            pending.append(Record(row.kind, row.step, row.name, row.values, time=row.time))
            weight += _weight(row)
            if weight >= BATCH_ROWS:
                flush()
        flush()
    except run_files.RunDirError as e:   # a file changed since it was inspected
        raise Invalid(f"not imported: {e}", e.errors) from None


def _end(rid: int, info: run_files.RunDir, user, source: str) -> None:
    """The run's end as its files say, then what the import itself has to say."""
    end = info.ending
    append(rid, [], {"step": info.last_step}, ring_bell=False)
    if end.status in lifecycle.WORKER_ENDS:
        end_run(rid, end.status, final_summary=end.summary, error=end.error, at=end.time)
    else:
        set_status(rid, lifecycle.LOST, only_from=lifecycle.END_FROM, at=end.time, error=end.error)
    records = [Record("event", info.last_step, "warning", {"message": w}) for w in info.warnings]
    records.append(Record("event", info.last_step, "imported", {
        "source": source, "by": user.get_username(), "fingerprint": info.fingerprint,
        "lines": info.lines, "checkpoints": [ck.name for ck in info.checkpoints]}))
    append(rid, records)
