"""The JSON API's endpoints (the table in docs/dashboard.md), each wearing base.api: session auth
(with CSRF) for the browser, `Authorization: Token <key>` for scripts (any other Authorization
scheme, e.g. an auth proxy's Basic, is left to the session). Errors are JSON with a message per
field, shortened (validation.clip_errors); bad input never gives a 500."""
from __future__ import annotations

import json

from django.conf import settings
from django.http import FileResponse, HttpResponse, JsonResponse, StreamingHttpResponse

from trainer import config as config_mod
from trainer.cli.export import ExportError
from trainer.pilot.thresholds import DEFAULT as DEFAULT_THRESHOLDS
from webapp.dashboard import actions
from webapp.dashboard.access import policy, validation
from webapp.dashboard.api.base import NotFound, api, error, get_run_or_404
from webapp.dashboard.models import ACTIVE, Estimate, KnobChange, Run, Status
from webapp.dashboard.reports import advice, cost, estimate, exports
from webapp.dashboard.rows import samples as sample_rows
from webapp.dashboard.rows import stream
from webapp.dashboard.rows import timeline as timeline_rows
from webapp.dashboard.worker import sweep


def run_json(run: Run, user, detail: bool = False) -> dict:
    d = {
        "id": run.pk, "name": run.name, "owner": run.owner.get_username(), "preset": run.preset,
        "status": run.status, "step": run.step, "max_steps": run.max_steps,
        "progress": round(run.progress, 4), "url": f"/runs/{run.pk}/",
        "created_at": run.created_at.isoformat(),
        "started_at": run.started_at.isoformat() if run.started_at else None,
        "finished_at": run.finished_at.isoformat() if run.finished_at else None,
        "heartbeat_at": run.heartbeat_at.isoformat() if run.heartbeat_at else None,
        "summary": run.summary, "error": run.error, "cursor": run.last_seq,
        "can_control": run.can_control(user), "queue": run.queue, "tags": run.tags,
        "archived": run.archived, "active_alerts": sorted(((run.alerts or {}).get("active") or {})),
        "parent": run.parent_id, "fork_step": run.fork_step,
        "cost": cost.headline(run),   # device-hours so far and their price (docs/cost.md)
    }
    if detail:
        d.update({"config": run.config, "knobs": run.knobs, "desired": run.desired,
                  "allowed_actions": run.allowed_actions,
                  "celery_task_id": run.celery_task_id, "worker_host": run.worker_host,
                  "note": run.note, "alerts": (run.alerts or {}).get("active") or {},
                  "pending_knob_changes": [
                      {"change_id": k.change_id, "knobs": k.knobs, "advice": k.advice}
                      for k in run.knob_changes.filter(status=KnobChange.PENDING)],
                  "forks": list(run.forks.order_by("pk").values_list("pk", flat=True)),
                  "checkpoints": actions.checkpoint_steps(run),   # the steps it can be forked from
                  # time and price to max_steps at the recent pace (docs/cost.md)
                  "forecast": cost.to_end(run) if run.status in ACTIVE else None,
                  "cost_so_far": cost.so_far_of(run),
                  # APRIL's rules of thumb beside the run's values (None when APRIL is off)
                  "april_context": advice.april_context(run)})
    return d


# --- endpoints -----------------------------------------------------------------------------------

@api("GET")
def knobs(request, body):
    return JsonResponse([p.as_json() for p in config_mod.schema()], safe=False)


@api("GET")
def presets(request, body):
    out = []
    for name in config_mod.preset_names():
        cfg = actions.shipped_preset(name)
        out.append({"name": name, "config": cfg.to_dict(), "toml": config_mod.to_toml(cfg),
                    "requires": config_mod.preset_requires(name)})
    return JsonResponse(out, safe=False)


@api("GET", "POST")
def runs(request, body):
    if request.method == "POST":
        unknown = set(body) - {"name", "preset", "overrides", "toml", "queue"}
        if unknown:
            return error(400, "unknown fields", {k: "unknown field; expected name, preset, overrides, "
                                                    "toml, queue" for k in sorted(unknown)})
        run = actions.launch_run(request.user, body.get("name"), body.get("preset"),
                                 body.get("overrides"), body.get("toml"), queue=body.get("queue"))
        return JsonResponse({"id": run.pk, "status": run.status, "url": f"/runs/{run.pk}/"}, status=201)
    sweep.mark_stale_runs()
    qs = filter_runs(Run.objects.select_related("owner"), request.GET)
    try:
        limit = max(1, min(500, int(request.GET.get("limit", 100))))
    except ValueError:
        return error(400, "bad limit", {"limit": "expected an integer"})
    return JsonResponse({"runs": [run_json(r, request.user) for r in qs[:limit]]})


@api("POST")
def estimates(request, body):
    """What a run would take: done at once from past runs of its shape (200), else a worker
    calibrates it (202: GET its url until done or failed)."""
    unknown = set(body) - {"preset", "overrides", "toml", "queue"}
    if unknown:
        return error(400, "unknown fields", {k: "unknown field; expected preset, overrides, toml, queue"
                                             for k in sorted(unknown)})
    cfg, queue = actions.estimate_config(request.user, body.get("preset"), body.get("overrides"),
                                         body.get("toml"), body.get("queue"))
    row = actions.record_estimate(request.user, cfg, queue, estimate.from_history(cfg))
    return JsonResponse(estimate.estimate_json(row), status=200 if row.status == row.DONE else 202)


@api("GET")
def estimate_detail(request, body, estimate_id: int):
    row = Estimate.objects.filter(pk=estimate_id).first()
    if row is None or not (row.owner_id == request.user.pk or request.user.is_staff):
        raise NotFound(f"no estimate {estimate_id}", {"id": "not found"})
    return JsonResponse(estimate.estimate_json(row))


def filter_runs(qs, params):
    def get(name):  # NUL never matches anything (and PostgreSQL refuses it in a query)
        return (params.get(name) or "").replace("\x00", "")
    if get("status"):   # only real statuses go into the query (a bounded IN list)
        qs = qs.filter(status__in=[s for s in set(get("status").split(",")) if s in Status.values])
    if get("owner"):
        qs = qs.filter(owner__username=get("owner"))
    if get("q"):
        qs = qs.filter(name__icontains=get("q"))
    archived = get("archived")
    if archived in ("1", "true", "only"):
        qs = qs.filter(archived=True)
    elif archived != "all":
        qs = qs.filter(archived=False)   # archived runs are hidden unless asked for
    if get("tag"):   # JSON list membership, portable across SQLite and PostgreSQL
        tag = get("tag")
        qs = qs.filter(pk__in=[pk for pk, tags in qs.values_list("pk", "tags") if tag in (tags or [])])
    return qs


@api("GET", "DELETE", "PATCH")
def run_detail(request, body, run_id: int):
    run = get_run_or_404(run_id)
    if request.method == "DELETE":
        actions.delete_run(run, request.user)
        return JsonResponse({"deleted": run_id})
    if request.method == "PATCH":   # {note?, tags?, archived?}
        unknown = set(body) - {"note", "tags", "archived"}
        if unknown:
            return error(400, "unknown fields", {k: "unknown field; expected note, tags, archived"
                                                 for k in sorted(unknown)})
        run = actions.annotate_run(run, request.user, body.get("note"), body.get("tags"), body.get("archived"))
        return JsonResponse(run_json(run, request.user, detail=True))
    sweep.mark_stale_runs()
    run.refresh_from_db()
    return JsonResponse(run_json(run, request.user, detail=True))


@api("GET")
def run_metrics(request, body, run_id: int):
    run = get_run_or_404(run_id)
    errors = {}
    after = request.GET.get("after")
    if after not in (None, ""):
        try:
            after = int(after)
            if after < 0:
                raise ValueError
        except ValueError:
            errors["after"] = "expected a cursor (a non-negative integer)"
        else:
            if after > run.last_seq:   # a cursor this run never gave out
                errors["after"] = (f"cursor {validation.clip(after, 40)} is past the run's last "
                                   f"cursor ({run.last_seq})")
    else:
        after = None
    try:
        max_points = int(request.GET.get("max_points", settings.CHART_MAX_POINTS))
        if not 4 <= max_points <= 100_000:
            raise ValueError
    except ValueError:
        errors["max_points"] = "expected an integer in [4, 100000]"
    keys = [k for k in request.GET.get("keys", "").replace("\x00", "").split(",") if k]
    if len(keys) > validation.MAX_METRIC_KEYS:
        errors["keys"] = f"at most {validation.MAX_METRIC_KEYS} metric names"
    if errors:
        return error(400, "bad query", errors)
    return JsonResponse(stream.metrics_snapshot(run, keys, after, max_points))


@api("GET")
def run_timeline(request, body, run_id: int):
    """Where each process's time went (webapp/dashboard/rows/timeline.py): `?last=N` the last N
    steps (the live page), else the whole run thinned to `max_slices` steps (default 150)."""
    run = get_run_or_404(run_id)
    errors, params = {}, {}
    for name, lo, hi in (("last", 1, 1000), ("max_slices", 2, 2000)):
        raw = request.GET.get(name)
        if raw in (None, ""):
            continue
        try:
            params[name] = int(raw)
            if not lo <= params[name] <= hi:
                raise ValueError
        except ValueError:
            errors[name] = f"expected an integer in [{lo}, {hi}]"
    if errors:
        return error(400, "bad query", errors)
    if "last" not in params:
        params.setdefault("max_slices", 150)
    return JsonResponse(timeline_rows.snapshot(run.pk, **params))


@api("GET")
def run_advice(request, body, run_id: int):
    """The pilot's advice on the run's last `?window=N` steps (default: the rules' own window;
    trainer/pilot/, docs/pilot.md). Anyone logged in may read it, as for metrics."""
    run = get_run_or_404(run_id)
    raw = request.GET.get("window")
    window = DEFAULT_THRESHOLDS.window
    if raw not in (None, ""):
        try:
            window = int(raw)
            if not 1 <= window <= 1000:
                raise ValueError
        except ValueError:
            return error(400, "bad query", {"window": "expected an integer in [1, 1000]"})
    return JsonResponse(advice.for_run(run, window))


@api("GET")
def run_samples(request, body, run_id: int):
    """The run's rollout samples, filtered and paged (samples.query: step, min_step, max_step,
    min_reward, max_reward, min_len, max_len, finish, reward_status, q, group, order, after,
    limit, fields). Anyone logged in may read them, as for metrics."""
    run = get_run_or_404(run_id)
    return JsonResponse(sample_rows.query(run.pk, request.GET))


@api("GET")
def run_sample(request, body, run_id: int, sample_id: int):
    """One sample whole (tokens, log-probabilities, version segments) and the other members of
    its group at that step."""
    run = get_run_or_404(run_id)
    found = sample_rows.detail(run.pk, sample_id)
    if found is None:
        raise NotFound(f"run {run.pk} has no sample {sample_id}", {"sample": "not found"})
    return JsonResponse(found)


EXPORTS = {"csv": "text/csv; charset=utf-8", "json": "application/json",
           "toml": "application/toml; charset=utf-8", "html": "text/html; charset=utf-8",
           "samples_csv": "text/csv; charset=utf-8", "adapter": "application/zip"}


def export_response(run, fmt: str, user, step: int | None = None) -> HttpResponse:
    """The export, made while holding one of the user's export slots (policy.take_export_slot):
    a streamed one until its stream is closed. `step`: the adapter's checkpoint (default the latest)."""
    give_back = policy.take_export_slot(user)
    if fmt == "adapter":
        return _adapter_response(run, step, give_back)
    if fmt == "samples_csv":   # streamed: per-token arrays of 20,000 samples can be large
        resp = StreamingHttpResponse(_SlotStream(exports.iter_samples_csv(run), give_back),
                                     content_type=EXPORTS[fmt])
        resp["Content-Disposition"] = f'attachment; filename="rlpilot-run-{run.pk}-samples.csv"'
        return resp
    try:
        if fmt == "csv":
            body = exports.export_csv(run)
        elif fmt == "json":
            body = json.dumps(exports.export_json(run), default=str)
        elif fmt == "toml":
            body = exports.export_toml(run)
        else:
            body = exports.export_html(run)
    finally:
        give_back()
    resp = HttpResponse(body, content_type=EXPORTS[fmt])
    resp["Content-Disposition"] = f'attachment; filename="rlpilot-run-{run.pk}.{fmt}"'
    return resp


def _adapter_response(run, step: int | None, give_back) -> HttpResponse:
    """A LoRA run's adapter as a .zip (exports.adapter_zip; the export slot is held while it is
    written); 404 naming why when there is none (no LoRA, no checkpoint)."""
    try:
        archive, filename = exports.adapter_zip(run, step)
    except exports.NoAdapter as e:
        raise NotFound(str(e), {"format": "no adapter to download"}) from None
    except ExportError as e:
        raise actions.Conflict(f"run {run.pk}'s adapter cannot be exported: {e}", {"format": str(e)}) from None
    finally:
        give_back()
    return FileResponse(archive, as_attachment=True, filename=filename, content_type=EXPORTS["adapter"])


class _SlotStream:
    """A streamed export's chunks; Django calls close() when the response ends (also when the
    client went away before the first chunk), which gives the export slot back."""

    def __init__(self, chunks, give_back):
        self.chunks, self.give_back = chunks, give_back

    def __iter__(self):
        return iter(self.chunks)

    def close(self):
        self.give_back()


@api("GET")
def run_export(request, body, run_id: int):
    """Full-resolution metrics as CSV / JSON (JSON with the rollout samples, without their
    per-token arrays), the config as TOML, a self-contained HTML report, or the rollout samples
    whole as CSV (samples_csv, streamed)."""
    run = get_run_or_404(run_id)
    fmt = request.GET.get("format", "json")
    if fmt not in EXPORTS:
        return error(400, "bad format", {"format": "one of " + ", ".join(EXPORTS)})
    step = None
    if fmt == "adapter":
        # a LoRA run's adapter is its weights: its owner's or staff's, as its checkpoints are
        # (policy.model_source_problem); the report and the metrics stay open to every user
        if not run.can_control(request.user):
            raise actions.Forbidden("only the run's owner or staff can download its adapter (its weights)")
        raw = request.GET.get("step")
        if raw not in (None, ""):
            if not raw.isascii() or not raw.isdigit() or len(raw) > 18:
                return error(400, "bad step", {"step": "expected a checkpoint's step (an integer)"})
            step = int(raw)
    return export_response(run, fmt, request.user, step)


def knob_request(body: dict) -> tuple[dict, dict | None]:
    """(knobs, advice) of a knob change's body: the knobs object itself (`{"optim.lr": 5e-5}`),
    or `{"knobs": {...}, "advice": {rule, reason, evidence_key}}` for a change made from the
    pilot's advice. Knob names are dotted, so a top-level `knobs` or `advice` is the wrapped form."""
    if "knobs" not in body and "advice" not in body:
        return body, None
    unknown = sorted(set(body) - {"knobs", "advice"})
    if unknown or "knobs" not in body:
        errors = {k: "unknown field; expected knobs, advice" for k in unknown}
        if "knobs" not in body:
            errors["knobs"] = 'required with advice: {"knobs": {dotted key: value}, "advice": {...}}'
        raise actions.Invalid("the knob change is malformed", errors)
    return body["knobs"], body.get("advice")


@api("POST")
def run_knobs(request, body, run_id: int):
    run = get_run_or_404(run_id)
    knobs, advice_marker = knob_request(body)
    change = actions.request_knobs(run, request.user, knobs, advice=advice_marker)
    return JsonResponse({"change_ids": [change.change_id], "change_id": change.change_id,
                         "knobs": change.knobs, "advice": change.advice, "status": "pending"}, status=202)


@api("POST")
def run_advice_dismiss(request, body, run_id: int):
    """Dismiss one piece of the run's current advice, `{"rule", "evidence_key", "window"?}`
    (owner or staff): an `advice_dismissed` event; GET .../advice flags it `dismissed` until
    that rule's evidence_key changes. 201 when recorded, 200 when it was already dismissed."""
    run = get_run_or_404(run_id)
    unknown = sorted(set(body) - {"rule", "evidence_key", "window"})
    if unknown:
        return error(400, "unknown fields", {k: "unknown field; expected rule, evidence_key, window"
                                             for k in unknown})
    window = body.get("window", DEFAULT_THRESHOLDS.window)
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= 1000:
        return error(400, "bad window", {"window": "expected an integer in [1, 1000] (the advice's window)"})
    if not run.can_control(request.user):   # before reading the metrics for the advice
        raise actions.Forbidden("only the run's owner or staff can dismiss its advice")
    current = advice.for_run(run, window)["advice"]
    done = actions.dismiss_advice(run, request.user, body.get("rule"), body.get("evidence_key"), current)
    return JsonResponse(done["dismissed"], status=201 if done["new"] else 200)


@api("POST")
def run_fork(request, body, run_id: int):
    """A new run from this run's checkpoint at `step`, with its config plus `overrides`
    (actions/fork.py); `name` optional."""
    run = get_run_or_404(run_id)
    unknown = set(body) - {"step", "overrides", "name"}
    if unknown:
        return error(400, "unknown fields", {k: "unknown field; expected step, overrides, name"
                                             for k in sorted(unknown)})
    if "step" not in body:
        return error(400, "the run was not forked", {"step": "required: the checkpoint step to fork from"})
    child = actions.fork_run(run, request.user, body.get("step"), body.get("overrides"), body.get("name"))
    return JsonResponse({"id": child.pk, "status": child.status, "url": f"/runs/{child.pk}/",
                         "parent": run.pk, "fork_step": child.fork_step}, status=201)


def make_control(action: str):
    @api("POST")
    def view(request, body, run_id: int):
        run = get_run_or_404(run_id)
        run = actions.control(run, request.user, action)
        # `seq`: the status is as of this sequence number; the page ignores it when the stream
        # has already brought a newer one (the worker may pause before this reply arrives)
        return JsonResponse({"id": run.pk, "status": run.status, "desired": run.desired,
                             "allowed_actions": run.allowed_actions, "seq": run.last_seq}, status=202)
    view.__name__ = f"run_{action}"
    return view


run_stop, run_pause, run_resume, run_kill = (make_control(a) for a in ("stop", "pause", "resume", "kill"))
