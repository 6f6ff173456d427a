"""A run's exports (GET /api/runs/<id>/export?format=..., `manage.py export_run`): every metric point
as CSV, the rollout samples as CSV, the whole run as JSON, its launch config as TOML, one
self-contained HTML report (Plotly, charts, data and tables inlined; no network), and a LoRA run's
adapter as a .zip (`adapter_zip`: written by the trainer's export in a temporary folder). Every
CSV goes through spreadsheet_safe. Reads only: nothing is written in the run's folder."""
from __future__ import annotations

import io
import json
import tempfile
import zipfile
from pathlib import Path
from typing import IO, Any

from django.conf import settings
from django.template.loader import render_to_string
from django.utils import timezone

from trainer import config as config_mod
from trainer.cli.export import export
from trainer.run.fork import checkpoint_steps
from webapp.dashboard import formatting
from webapp.dashboard.actions import run_dir
from webapp.dashboard.models import HistogramSnapshot, MetricPoint, RolloutSample, Run, RunEvent
from webapp.dashboard.reports import cost, summary
from webapp.dashboard.reports.spreadsheet_safe import SafeWriter
from webapp.dashboard.rows import samples as sample_rows
from webapp.dashboard.rows import stream
from webapp.dashboard.rows import timeline as timeline_rows


def _iso(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**r, "time": r["time"].isoformat()} for r in rows]


def all_points(run: Run):
    """Every point written, in order: (seq, step, key, value); NaN/inf are stored as NULL."""
    return (MetricPoint.objects.filter(run_id=run.pk).order_by("seq", "id")
            .values_list("seq", "step", "key", "value").iterator(chunk_size=5000))


def export_csv(run: Run) -> str:
    buf = io.StringIO()
    w = SafeWriter(buf)
    w.writerow(["seq", "step", "key", "value"])
    for seq, step, key, value in all_points(run):
        w.writerow([seq, step, key, "" if value is None else value])
    return buf.getvalue()


def full_series(run: Run) -> dict[str, dict[str, list]]:
    series: dict[str, dict[str, list]] = {}
    for _, step, key, value in all_points(run):
        s = series.setdefault(key, {"steps": [], "values": []})
        s["steps"].append(step)
        s["values"].append(value)
    return series


def run_meta(run: Run) -> dict[str, Any]:
    return {"id": run.pk, "name": run.name, "owner": run.owner.get_username(), "preset": run.preset,
            "status": run.status, "step": run.step, "max_steps": run.max_steps, "queue": run.queue,
            "worker_host": run.worker_host, "note": run.note, "tags": run.tags, "archived": run.archived,
            "created_at": run.created_at.isoformat(),
            "started_at": run.started_at.isoformat() if run.started_at else None,
            "finished_at": run.finished_at.isoformat() if run.finished_at else None,
            "error": run.error, "parent": run.parent_id, "fork_step": run.fork_step}


def export_json(run: Run) -> dict[str, Any]:
    return {"run": run_meta(run), "config": run.config, "knobs": run.knobs, "summary": summary.summary(run),
            "trainer_summary": (run.summary or {}).get("final"),
            "metrics": full_series(run),
            "histograms": [{"step": h.step, "name": h.name, "edges": h.edges, "counts": h.counts}
                           for h in HistogramSnapshot.objects.filter(run_id=run.pk).order_by("seq")],
            "events": [{"seq": e.seq, "step": e.step, "kind": e.kind, "time": e.time.isoformat(),
                        "data": e.data} for e in RunEvent.objects.filter(run_id=run.pk).order_by("seq")],
            "knob_timeline": _iso(summary.knob_timeline(run)),
            "advice": {part: _iso(rows) for part, rows in summary.advice_history(run).items()},
            "timeline": [{"step": t["step"], "spans": t["spans"]}
                         for t in timeline_rows.snapshot(run.pk)["slices"]],   # every step's spans
            # every sample but its per-token arrays (the samples CSV has those: they can be large)
            "samples": list(sample_rows.export_rows(run.pk, per_token=False))}


SAMPLE_COLUMNS = ["id", "seq", "step", "group", "index", "why", "finish", "length", "reward", "score",
                  "penalty", "advantage", "staleness", "tis_weight", "reward_status", "reward_error",
                  "segments", "prompt", "completion", "tokens", "logprobs", "turns", "episode"]
_JSON_COLUMNS = ("segments", "tokens", "logprobs", "turns", "episode")


def iter_samples_csv(run: Run):
    """The run's rollout samples as CSV lines, one row each (segments, tokens and
    log-probabilities as JSON; a missing number empty), produced as they are read."""
    buf = io.StringIO()
    w = SafeWriter(buf)
    w.writerow(SAMPLE_COLUMNS)
    for s in sample_rows.export_rows(run.pk):
        w.writerow([json.dumps(s[c], ensure_ascii=False) if c in _JSON_COLUMNS
                    else "" if s[c] is None else s[c] for c in SAMPLE_COLUMNS])
        yield buf.getvalue()
        buf.seek(0)
        buf.truncate()
    yield buf.getvalue()


def export_samples_csv(run: Run) -> str:
    return "".join(iter_samples_csv(run))


REPORT_SAMPLES = 1000       # samples in the offline HTML report's table (the latest)
REPORT_TEXT = 4000          # characters of a prompt or completion shown there


def _versions(segments) -> str:
    """[[version, tokens], ...] as text: an episode's environment runs (version -1) as "env"."""
    return ", ".join(f"{'env' if v == -1 else f'v{v}'}×{n}" for v, n in (segments or []))


def _episode_text(ep: dict) -> str:
    if not ep:
        return ""
    errors = f" ({ep.get('tool_errors')} failed)" if ep.get("tool_errors") else ""
    return (f"{ep.get('turns')} turn{'' if ep.get('turns') == 1 else 's'}, "
            f"{ep.get('tool_calls')} tool call{'' if ep.get('tool_calls') == 1 else 's'}{errors}"
            + (f", ended: {ep['end']}" if ep.get("end") else ""))


def _turn_texts(turns, tokens) -> list[dict[str, Any]]:
    """An episode's completion, turn by turn: {"role", "text"} (a tool's turn is never trained)."""
    out = []
    for t in turns:
        text = "".join(tokens[t["start"]:t["end"]])
        out.append({"role": t["role"], "text": text if len(text) <= REPORT_TEXT else text[:REPORT_TEXT] + "…"})
    return out


def report_samples(run: Run, limit: int = REPORT_SAMPLES) -> dict[str, Any]:
    """The offline report's sample table: the latest `limit` samples, texts shortened; an
    episode's completion also turn by turn."""
    qs = RolloutSample.objects.filter(run_id=run.pk)
    rows = []
    picked = list(qs.order_by("-seq", "-id").defer("tokens", "logprobs")[:limit])
    episodes = [s.pk for s in picked if s.turns]
    tokens = dict(RolloutSample.objects.filter(pk__in=episodes).values_list("pk", "tokens")) if episodes else {}
    for s in picked:
        rows.append({"id": s.pk, "step": s.step, "group": s.group, "index": s.index, "length": s.length,
                     "reward": formatting.figure(s.reward), "score": formatting.figure(s.score),
                     "finish": s.finish, "why": s.why,
                     "reward_status": s.reward_status, "reward_error": s.reward_error,
                     "staleness": s.staleness,
                     "versions": _versions(s.segments), "episode": _episode_text(s.episode),
                     "turns": _turn_texts(s.turns, tokens.get(s.pk) or []) if s.turns else [],
                     "prompt": s.prompt if len(s.prompt) <= REPORT_TEXT else s.prompt[:REPORT_TEXT] + "…",
                     "completion": (s.completion if len(s.completion) <= REPORT_TEXT
                                    else s.completion[:REPORT_TEXT] + "…")})
    rows.reverse()
    return {"rows": rows, "total": qs.count(), "limit": limit}


def export_toml(run: Run) -> str:
    head = (f"# rlpilot run {run.pk} {json.dumps(run.name)} ({run.status}): the launch config.\n"
            f"# Knob values at the end: {json.dumps(run.knobs, sort_keys=True)}\n")
    return head + config_mod.to_toml(config_mod.from_dict(run.config))


def _inline_script(source: str) -> str:
    return source.replace("</script", "<\\/script").replace("<!--", "<\\!--")


class NoAdapter(Exception):
    """Why a run has no adapter to download: a full fine-tuning run, or no checkpoint yet."""


def adapter_steps(run: Run) -> list[int]:
    """The checkpoint steps a LoRA run's adapter can be downloaded from (oldest first); [] for a
    run without LoRA (lora.rank = 0) or without a checkpoint on disk."""
    rank = ((run.config or {}).get("lora") or {}).get("rank") or 0
    return checkpoint_steps(run_dir(run.pk)) if rank > 0 else []


def adapter_zip(run: Run, step: int | None = None) -> tuple[IO[bytes], str]:
    """(an open temporary file holding a .zip of the run's LoRA adapter, its file name): the
    trainer's `export(..., adapter=True)` (PEFT's adapter_config.json and
    adapter_model.safetensors, with the tokenizer) of the checkpoint at `step` (default the
    latest), in one folder. Written in a temporary folder, removed before this returns; the
    file goes when it is closed. The run's own folder is only read. Raises NoAdapter (no LoRA,
    no such checkpoint) or trainer.cli.export.ExportError (what the trainer's export refuses)."""
    if not (((run.config or {}).get("lora") or {}).get("rank") or 0) > 0:
        raise NoAdapter(f"run {run.pk} trains the whole model (lora.rank = 0): it has no LoRA adapter")
    steps = adapter_steps(run)
    if not steps:
        raise NoAdapter(f"run {run.pk} has no checkpoint on disk yet: its adapter is exported "
                        "from a checkpoint")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise NoAdapter(f"run {run.pk} has no checkpoint at step {step}; its checkpoints are at "
                        f"step{'s' if len(steps) > 1 else ''} " + ", ".join(map(str, steps)))
    name = f"rlpilot-run-{run.pk}-adapter-step-{step}"
    with tempfile.TemporaryDirectory(prefix="rlpilot-adapter-") as tmp:
        # the trainer's export reads a run folder (config.toml + checkpoints/): one made of the
        # run's config as the dashboard holds it (an imported run's folder has no config.toml)
        # and a link to the run's checkpoints, so nothing is written beside them
        source = Path(tmp) / "run"
        source.mkdir()
        (source / "config.toml").write_text(config_mod.to_toml(config_mod.from_dict(run.config)))
        (source / "checkpoints").symlink_to(run_dir(run.pk) / "checkpoints", target_is_directory=True)
        out = Path(tmp) / name
        try:
            export(source, out, adapter=True, step=step)
        except FileNotFoundError as e:   # the checkpoint went (rotated away) while it was read
            raise NoAdapter(f"run {run.pk}'s checkpoint at step {step} is gone ({e.strerror}); "
                            "try again") from None
        archive = tempfile.TemporaryFile(prefix="rlpilot-adapter-", suffix=".zip")
        try:
            with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as z:
                for f in sorted(out.rglob("*")):
                    if f.is_file():
                        z.write(f, f"{name}/{f.relative_to(out).as_posix()}")
        except BaseException:
            archive.close()
            raise
    archive.seek(0)
    return archive, name + ".zip"


def export_html(run: Run, max_points: int = 2000) -> str:
    """One HTML file: Plotly, the chart code, the data and the tables inlined; no network."""
    static = settings.BASE_DIR / "static"
    snap = stream.metrics_snapshot(run, None, None, max_points, max_histograms=300, max_events=2000)
    account = cost.account(run)   # read once: the summary's figures and the Cost card
    return render_to_string("dashboard/report_export.html", {
        "run": run, "rows": summary.summary_rows(summary.summary(run, account)),
        "timeline": summary.knob_timeline(run), "cost": cost.view(account),
        "trains": summary.trains(run), "advice": summary.advice_history(run),
        "sandbox_warning": summary.sandbox_warning(run),
        "alerts": summary.alerts(run),
        "events": summary.event_rows(RunEvent.objects.filter(run_id=run.pk).order_by("seq")[:2000]),
        "config_toml": export_toml(run), "generated": timezone.now(), "samples": report_samples(run),
        "css": (static / "dashboard" / "style.css").read_text(),
        "plotly_js": _inline_script((static / "vendor" / "plotly.min.js").read_text()),
        "common_js": _inline_script((static / "dashboard" / "common.js").read_text()),
        "charts_js": _inline_script((static / "dashboard" / "charts.js").read_text()),
        "timeline_js": _inline_script((static / "dashboard" / "timeline.js").read_text()),
        "timeline_data": timeline_rows.snapshot(run.pk, max_slices=150),
        "data": {"points": snap["points"], "histograms": snap["histograms"],
                 "events": snap["events"], "config": run.config, "knobs": run.knobs},
    })
