"""HTML pages: the runs list with the launch form, the live run page, the report page (notes,
tags, archive, delete, checkpoints) and the comparison of runs."""
from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from trainer import config as config_mod
from trainer.pilot import april as pilot_april
from webapp.dashboard import actions, formatting
from webapp.dashboard.access import validation
from webapp.dashboard.api.endpoints import filter_runs
from webapp.dashboard.models import ACTIVE, RESUMABLE, Run, RunEvent, Status
from webapp.dashboard.pages import agents
from webapp.dashboard.reports import advice, comparison, cost, exports, summary
from webapp.dashboard.worker import sweep

FIELD_PREFIX = "cfg:"


# APRIL's rules of thumb beside its fields, as context: nothing enforces them (the pilot's APRIL
# advice cites them with the run's values: trainer/pilot/april.py)
APRIL_NOTE = ("Rules of thumb, not enforced: over_sampling_batch_size at {lo:g}-{hi:g}x "
              "rollout.rollout_batch_size (0 = 2x); segment_max_tokens first at half of the longest "
              "response (0 = half of rollout.max_response_len), then adjusted from the idle decode "
              "slots. Within max_version_span an answer gets at most segment_max_tokens x "
              "rollout.max_sampling_rounds x (max_version_span + 1) tokens; a longer one gets its "
              "last chance: generated to its end without segments, the step waiting for it. "
              "python -m trainer advise and the run page's advice cite these beside the run's "
              "values.").format(lo=pilot_april.OVERSAMPLE_RULE[0], hi=pilot_april.OVERSAMPLE_RULE[1])


def _section_notes() -> dict[str, str]:
    """A line under a section's title, where its fields need the server's context or say where
    what they do shows."""
    limit = settings.RLPILOT_MAX_TRAIN_PROCS
    most = (f"this server allows up to {limit} (RLPILOT_MAX_TRAIN_PROCS)" if limit > 0
            else "at most the worker's GPU count (CPU count for a CPU model)")
    return {"april": APRIL_NOTE,
            "cluster": "The run's processes on the worker's machine. cluster.train_procs above 1: the "
                       "worker starts torchrun with that many training processes (rank 0 owns the "
                       "rollout and reports here; stop, pause, knob changes and kill reach every "
                       f"process at the same step); {most}.",
            "mismatch": "The training–inference mismatch: how far the engine's log-probabilities are "
                        "from the trainer's (the run page's \"Engine vs trainer\" charts), and a "
                        "correction of the loss by their ratio. rollout.dtype sets the engine's "
                        "precision apart from the trainer's: bfloat16 shows a real mismatch on CPU."}


def _sections(errors: dict[str, str], values: dict[str, str], base: dict | None = None):
    """The launch form's fields, grouped by section, straight from the trainer's schema; an
    empty field shows the value it keeps: the default, or `base`'s (the fork form: the parent's)."""
    out: dict[str, list] = {}
    for p in config_mod.schema():
        section = p.name.split(".")[0]
        refused = validation.unavailable_choices(p.name)
        out.setdefault(section, []).append({
            "name": p.name, "field": FIELD_PREFIX + p.name, "type": p.as_json()["type"],
            "choices": [{"value": c, "refused": refused.get(c, "")} for c in p.choices]
                       if p.choices else None, "default": p.default,
            "placeholder": _shown(p.default if base is None else base.get(p.name, p.default)),
            "min": p.min, "max": p.max, "help": p.help, "tunable": p.tunable,
            "allowed": p.allowed(), "value": values.get(p.name, ""), "error": errors.get(p.name, ""),
        })
    notes = _section_notes()
    return [{"name": s, "fields": f, "has_error": any(x["error"] for x in f), "note": notes.get(s, "")}
            for s, f in out.items()]


def _shown(v):
    """A value as the form's fields take it (TOML's true/false, not Python's True/False; a list
    comma-separated, "(none)" when empty)."""
    if isinstance(v, (list, tuple)):
        return ", ".join(map(str, v)) or "(none)"
    return ("true" if v else "false") if isinstance(v, bool) else v


@login_required
@require_http_methods(["GET", "POST"])
def runs_page(request):
    errors: dict[str, str] = {}
    values: dict[str, str] = {}
    form = {"name": "", "preset": "demo" if "demo" in config_mod.preset_names() else "", "toml": "",
            "queue": ""}
    if request.method == "POST":
        form = {"name": request.POST.get("name", ""), "preset": request.POST.get("preset", ""),
                "toml": request.POST.get("toml", ""), "queue": request.POST.get("queue", "")}
        overrides, values = _posted_fields(request.POST)
        try:
            run = actions.launch_run(request.user, form["name"], form["preset"] or None, overrides,
                                     form["toml"] if form["toml"].strip() else None,
                                     queue=form["queue"] or None)
        except actions.Invalid as e:
            errors = e.errors
            field_errors = set(errors) - {"runs"}  # "runs": the per-user limit, no field to fix
            messages.error(request, "The run was not launched: " + (
                "fix the fields marked below." if field_errors else errors.get("runs", e.message)))
        else:
            return redirect("run", run_id=run.pk)
    sweep.mark_stale_runs()
    runs = list(filter_runs(Run.objects.select_related("owner"), request.GET)[:200])
    compare_error = request.GET.get("compare_error", "")
    for r in runs:
        latest = (r.summary or {}).get("latest", {})
        r.figures = [formatting.number(v, digits=3) if isinstance(v := latest.get(k), (int, float)) else ""
                     for k in ("reward/accuracy", "reward/mean", "rollout/response_len/mean", "perf/gen_tokens_per_s")]
        paid = cost.headline(r) or {}
        r.figures += [formatting.number(v, digits=3) if v is not None else ""
                      for v in (paid.get("device_hours"), paid.get("price"))]
    known = set(p.name for p in config_mod.schema()) | {"name", "preset", "toml", "queue"}
    presets = {name: actions.shipped_preset(name) for name in config_mod.preset_names()}   # the model.path it will use
    ctx = {
        "runs": runs, "statuses": [s.value for s in Status], "filters": request.GET,
        "sections": _sections(errors, values), "form": form, "errors": errors,
        "other_errors": {k: v for k, v in errors.items() if k not in known},
        # (name, what an opt-in preset needs or None): the form says it before a launch is refused
        "presets": [(name, config_mod.preset_requires(name)) for name in presets],
        # each preset's full TOML (the editor's "load") and its values by dotted key (placeholders)
        "preset_toml": {name: {"toml": config_mod.to_toml(cfg),
                               "values": {p.name: _shown(cfg.get(p.name)) for p in config_mod.schema()}}
                        for name, cfg in presets.items()},
        "owners": sorted(set(Run.objects.values_list("owner__username", flat=True))),
        "queues": settings.RLPILOT_QUEUES, "compare_error": compare_error,
        "ended": [Status.STOPPED, Status.FINISHED, Status.FAILED, Status.INTERRUPTED],
        "max_import_mib": settings.MAX_IMPORT_BYTES // 2**20,
    }
    return render(request, "dashboard/runs.html", ctx, status=400 if errors else 200)


def _posted_fields(post) -> tuple[dict[str, str], dict[str, str]]:
    """(overrides, values as typed) of a form's non-empty config fields."""
    overrides, values = {}, {}
    for key, raw in post.items():
        if key.startswith(FIELD_PREFIX) and raw.strip() != "":
            overrides[key[len(FIELD_PREFIX):]] = raw.strip()
            values[key[len(FIELD_PREFIX):]] = raw
    return overrides, values


def _lineage(run: Run) -> dict:
    """The run's parent and forks, for the pages' links."""
    return {"parent_run": run.parent, "fork_runs": list(run.forks.order_by("pk"))}


@login_required
@require_http_methods(["GET", "POST"])
def fork_page(request, run_id: int):
    """Fork a run: a checkpoint step (those on disk) and the config fields to override; the new
    run is queued and its page opens (actions/fork.py)."""
    run = _get_run(run_id)
    if not run.can_control(request.user):
        messages.error(request, "Only the run's owner or staff can fork it (its checkpoints are theirs).")
        return redirect("run-report", run_id=run.pk)
    steps = actions.checkpoint_steps(run)
    errors: dict[str, str] = {}
    values: dict[str, str] = {}
    chosen = request.GET.get("step") or (str(steps[-1]) if steps else "")
    name = ""
    if request.method == "POST":
        overrides, values = _posted_fields(request.POST)
        chosen, name = request.POST.get("step", ""), request.POST.get("name", "")
        step = int(chosen) if chosen.isdigit() else chosen
        try:
            child = actions.fork_run(run, request.user, step, overrides, name.strip() or None)
        except actions.Invalid as e:
            errors = e.errors
            messages.error(request, "The run was not forked: " + (
                errors.get("runs", "") or "fix the fields marked below."))
        else:
            return redirect("run", run_id=child.pk)
    base = comparison.flatten(run.config)
    known = set(p.name for p in config_mod.schema()) | {"name", "step"}
    return render(request, "dashboard/fork.html", {
        "run": run, "steps": steps, "chosen": chosen, "name": name, "errors": errors,
        "sections": _sections(errors, values, base),
        "other_errors": {k: v for k, v in errors.items() if k not in known},
    }, status=400 if errors else 200)


@login_required
@require_POST
def run_import(request):
    """The runs page's upload: a CLI run directory as an archive (actions.import_archive)."""
    try:   # refused before the body is read: an upload past the limit is never stored
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    if length > settings.MAX_IMPORT_BYTES:
        messages.error(request, f"Not imported: the upload is larger than the {settings.MAX_IMPORT_BYTES} "
                                "bytes this server accepts (RLPILOT_MAX_IMPORT_BYTES).")
        return redirect("runs")
    upload = request.FILES.get("archive")
    if upload is None:
        messages.error(request, "Not imported: choose a .zip or .tar.gz of a run directory.")
        return redirect("runs")
    try:
        done = actions.import_archive(request.user, upload, upload.size, upload.name,
                                      request.POST.get("name", "").strip() or None)
    except actions.ActionError as e:
        messages.error(request, e.message[0].upper() + e.message[1:])
        return redirect("runs")
    for w in done.warnings:
        messages.warning(request, w)
    messages.info(request, f"Imported as run #{done.run.pk} ({done.run.status}).")
    return redirect("run", run_id=done.run.pk)


@login_required
def run_page(request, run_id: int):
    run = Run.objects.select_related("owner").filter(pk=run_id).first()
    if run is None:
        raise Http404("no such run")
    sweep.mark_stale_runs()
    run.refresh_from_db()
    knobs = [p.as_json() for p in config_mod.knobs()]
    page = {"id": run.pk, "name": run.name, "status": run.status, "seq": run.last_seq, "step": run.step,
            "max_steps": run.max_steps, "knobs": run.knobs, "config": run.config,
            "can_control": run.can_control(request.user), "knob_schema": knobs,
            "owner": run.owner.get_username(), "user": request.user.get_username(),
            "active_statuses": list(ACTIVE), "allowed_actions": run.allowed_actions,
            "april_context": advice.april_context(run)}
    return render(request, "dashboard/run.html", {"run": run, "page": page, "active_alerts": active_alerts(run),
                                                  "tracker_links": tracker_links(run),
                                                  "agents": agents.panel(run, request.user),
                                                  "trains": summary.trains(run),
                                                  "sandbox_warning": summary.sandbox_warning(run),
                                                  "invariants": summary.invariants(run),
                                                  "config_toml": config_mod.to_toml(config_mod.from_dict(run.config)),
                                                  **_lineage(run)})


def tracker_links(run: Run) -> list[dict]:
    """The web pages of the trackers the run mirrors to (run.report_to: W&B online, a remote
    MLflow), from their `tracker_started` events; only http(s) addresses become links."""
    out = {}
    for data in RunEvent.objects.filter(run_id=run.pk, kind="tracker_started").order_by("seq").values_list(
            "data", flat=True):
        url = str((data or {}).get("url") or "")
        if url.startswith(("https://", "http://")):
            out[str(data.get("tracker") or "tracker")] = url   # a resume's event replaces the first
    return [{"tracker": k, "url": v} for k, v in out.items()]


def active_alerts(run: Run) -> list[dict]:
    return [{"rule": rule, **a} for rule, a in ((run.alerts or {}).get("active") or {}).items()]


def _get_run(run_id: int) -> Run:
    run = Run.objects.select_related("owner").filter(pk=run_id).first()
    if run is None:
        raise Http404("no such run")
    return run


@login_required
def report_page(request, run_id: int):
    """A run's report: config, summary, static charts, knob timeline, alerts, events,
    checkpoints; note, tags, archive and delete for its owner or staff."""
    run = _get_run(run_id)
    sweep.mark_stale_runs()
    run.refresh_from_db()
    events = list(RunEvent.objects.filter(run_id=run.pk).order_by("-seq")[:1000])
    events.reverse()
    page = {"id": run.pk, "config": run.config, "knobs": run.knobs}
    adapter_steps = exports.adapter_steps(run)   # a LoRA run's checkpoints: its adapter's download
    account = cost.account(run)   # read once: the summary's figures and the Cost card
    return render(request, "dashboard/report.html", {
        "run": run, "page": page, "rows": summary.summary_rows(summary.summary(run, account)),
        "cost": cost.view(account),
        "timeline": summary.knob_timeline(run), "advice": summary.advice_history(run),
        "alert_history": summary.alerts(run),
        "active_alerts": active_alerts(run), "events": summary.event_rows(events),
        "checkpoints": summary.checkpoints(run), "trains": summary.trains(run),
        "sandbox_warning": summary.sandbox_warning(run),
        "invariants": summary.invariants(run),
        "adapter_step": adapter_steps[-1] if adapter_steps else None,
        "config_toml": config_mod.to_toml(config_mod.from_dict(run.config)),
        "can_control": run.can_control(request.user), "is_active": run.status in ACTIVE,
        "resumable": run.status in RESUMABLE, "tags_text": ", ".join(run.tags or []),
        **_lineage(run),
    })


@login_required
@require_POST
def run_annotate(request, run_id: int):
    """The report page's note/tags form and archive button (owner or staff)."""
    run = _get_run(run_id)
    fields = {}
    if "note" in request.POST:
        fields["note"] = request.POST["note"]
    if "tags" in request.POST:
        fields["tags"] = request.POST["tags"]
    if "archived" in request.POST:
        fields["archived"] = request.POST["archived"] == "true"
    try:
        actions.annotate_run(run, request.user, **fields)
    except actions.Forbidden as e:
        messages.error(request, e.message)
        return redirect("run-report", run_id=run_id)
    except actions.ActionError as e:
        messages.error(request, e.message + ": " + "; ".join(f"{k}: {v}" for k, v in e.errors.items()))
        return redirect("run-report", run_id=run_id)
    messages.info(request, "Saved.")
    return redirect("run-report", run_id=run_id)


@login_required
@require_POST
def run_checkpoint(request, run_id: int, step: int):
    """Resume the run from this checkpoint, or launch a new run from it."""
    run = _get_run(run_id)
    path = summary.checkpoint_path(run, step)
    if path is None:
        raise Http404("no such checkpoint")
    what = request.POST.get("action")
    try:
        if what == "resume":
            actions.control(run, request.user, "resume", resume_step=step)
            return redirect("run", run_id=run.pk)
        if what == "new":
            name = (request.POST.get("name") or f"{run.name} from step {step}")[:200]
            toml = config_mod.to_toml(config_mod.from_dict(run.config))
            new = actions.launch_run(request.user, name, None, {"model.path": f"{path}/model"}, toml,
                                     queue=run.queue if run.queue in settings.RLPILOT_QUEUES else None)
            return redirect("run", run_id=new.pk)
    except actions.ActionError as e:
        messages.error(request, e.message + (": " + "; ".join(f"{k}: {v}" for k, v in e.errors.items())
                                             if e.errors else ""))
        return redirect("run-report", run_id=run_id)
    messages.error(request, "unknown checkpoint action")
    return redirect("run-report", run_id=run_id)


def parse_ids(params) -> list[int]:
    raw = []
    for v in params.getlist("ids"):
        raw += [x for x in v.replace(" ", ",").split(",") if x]
    ids = []
    for x in raw:
        try:
            i = int(x)
        except ValueError:
            continue
        if i not in ids:
            ids.append(i)
    return ids


def _band(run: Run) -> dict:
    """The run's mismatch.lower / mismatch.upper as the charts read them (state.config and knobs)."""
    section = dict((run.config or {}).get("mismatch") or {})
    for k in ("lower", "upper"):
        if f"mismatch.{k}" in (run.knobs or {}):
            section[k] = run.knobs[f"mismatch.{k}"]
    return {k: section[k] for k in ("lower", "upper") if k in section}


@login_required
def compare_page(request):
    """2-8 runs overlaid: one chart per metric (EMA smoothing), the config diff, the summaries
    side by side with ratios against the first run."""
    ids = parse_ids(request.GET)
    if not 2 <= len(ids) <= 8:
        messages.error(request, "Pick 2 to 8 runs to compare.")
        return redirect("runs")
    # an id past the database's 64-bit integers names no run (the query would overflow)
    possible = [i for i in ids if 0 <= i <= validation.MAX_ID]
    found = {r.pk: r for r in Run.objects.select_related("owner").filter(pk__in=possible)}
    missing = [i for i in ids if i not in found]
    if missing:
        raise Http404(f"no run {missing[0]}")
    runs = [found[i] for i in ids]
    summaries = [summary.summary(r) for r in runs]
    # a fork's steps continue its parent's numbering (it resumes the parent's checkpoint): both
    # are drawn at x = step, so they overlay from the fork step, marked on every chart
    # each run's mismatch band (current knob values, else its config's; absent before the section
    # existed): compare.js draws its ends on the chart of the |Δ log p| a band chart shows
    # each run's cost and accuracy: compare.js draws accuracy against cost, one point per run
    page = {"runs": [{"id": r.pk, "name": r.name, "status": r.status, "parent": r.parent_id,
                      "fork_step": r.fork_step, "mismatch": _band(r),
                      "cost": {k: s.get(k) for k in ("device_hours", "cost_price", "eval_accuracy_best",
                                                      "accuracy_best")}}
                     for r, s in zip(runs, summaries)]}
    return render(request, "dashboard/compare.html", {
        "runs": runs, "rows": comparison.compare_rows(runs, summaries), "diff": comparison.config_diff(runs),
        "headlines": comparison.headlines(runs, summaries), "page": page,
    })


@login_required
@require_POST
def run_delete(request, run_id: int):
    run = Run.objects.filter(pk=run_id).first()
    if run is None:
        raise Http404("no such run")
    if request.POST.get("confirm") != "delete" and run.can_control(request.user):
        messages.error(request, "Not deleted: tick the confirmation box first.")
        return redirect("run-report", run_id=run_id)
    try:
        actions.delete_run(run, request.user)
    except actions.ActionError as e:
        messages.error(request, e.message)
        return redirect("run-report", run_id=run_id)
    messages.info(request, f"Run {run_id} deleted.")
    return redirect("runs")
