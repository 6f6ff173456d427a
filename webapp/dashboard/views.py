"""HTML pages: the runs list with the launch form, and the live run page."""
from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from trainer import config as config_mod
from webapp.dashboard import actions
from webapp.dashboard.api import filter_runs
from webapp.dashboard.models import Run, Status

FIELD_PREFIX = "cfg:"


def _sections(errors: dict[str, str], values: dict[str, str]):
    """The launch form's fields, grouped by section, straight from the trainer's schema."""
    out: dict[str, list] = {}
    for p in config_mod.schema():
        section = p.name.split(".")[0]
        out.setdefault(section, []).append({
            "name": p.name, "field": FIELD_PREFIX + p.name, "type": p.as_json()["type"],
            "choices": list(p.choices) if p.choices else None, "default": p.default,
            "min": p.min, "max": p.max, "help": p.help, "tunable": p.tunable,
            "allowed": p.allowed(), "value": values.get(p.name, ""), "error": errors.get(p.name, ""),
        })
    return [{"name": s, "fields": f, "has_error": any(x["error"] for x in f)} for s, f in out.items()]


def _fmt(v) -> str:
    if not isinstance(v, (int, float)):
        return ""
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


@login_required
@require_http_methods(["GET", "POST"])
def runs_page(request):
    errors: dict[str, str] = {}
    values: dict[str, str] = {}
    form = {"name": "", "preset": "demo" if "demo" in config_mod.preset_names() else "", "toml": ""}
    if request.method == "POST":
        form = {"name": request.POST.get("name", ""), "preset": request.POST.get("preset", ""),
                "toml": request.POST.get("toml", "")}
        overrides = {}
        for key, raw in request.POST.items():
            if key.startswith(FIELD_PREFIX) and raw.strip() != "":
                overrides[key[len(FIELD_PREFIX):]] = raw.strip()
                values[key[len(FIELD_PREFIX):]] = raw
        try:
            run = actions.launch_run(request.user, form["name"], form["preset"] or None, overrides,
                                     form["toml"] if form["toml"].strip() else None)
        except actions.Invalid as e:
            errors = e.errors
            messages.error(request, "The run was not launched: fix the fields marked below.")
        else:
            return redirect("run", run_id=run.pk)
    actions.mark_stale_runs()
    runs = list(filter_runs(Run.objects.select_related("owner"), request.GET)[:200])
    for r in runs:
        latest = (r.summary or {}).get("latest", {})
        r.figures = [_fmt(latest.get(k)) for k in ("reward/accuracy", "reward/mean",
                                                   "rollout/response_len/mean", "perf/gen_tokens_per_s")]
    known = set(p.name for p in config_mod.schema()) | {"name", "preset", "toml"}
    presets = {name: config_mod.to_toml(config_mod.from_dict(config_mod.preset_dict(name)))
               for name in config_mod.preset_names()}
    ctx = {
        "runs": runs, "statuses": [s.value for s in Status], "filters": request.GET,
        "sections": _sections(errors, values), "form": form, "errors": errors,
        "other_errors": {k: v for k, v in errors.items() if k not in known},
        "presets": list(presets), "preset_toml": presets,
        "owners": sorted(set(Run.objects.values_list("owner__username", flat=True))),
    }
    return render(request, "dashboard/runs.html", ctx, status=400 if errors else 200)


@login_required
def run_page(request, run_id: int):
    run = Run.objects.select_related("owner").filter(pk=run_id).first()
    if run is None:
        raise Http404("no such run")
    actions.mark_stale_runs()
    run.refresh_from_db()
    knobs = [p.as_json() for p in config_mod.knobs()]
    page = {"id": run.pk, "name": run.name, "status": run.status, "step": run.step,
            "max_steps": run.max_steps, "knobs": run.knobs, "config": run.config,
            "can_control": run.can_control(request.user), "knob_schema": knobs,
            "owner": run.owner.get_username(), "user": request.user.get_username()}
    return render(request, "dashboard/run.html", {"run": run, "page": page,
                                                  "config_toml": config_mod.to_toml(config_mod.from_dict(run.config))})


@login_required
@require_POST
def run_delete(request, run_id: int):
    run = Run.objects.filter(pk=run_id).first()
    if run is None:
        raise Http404("no such run")
    try:
        actions.delete_run(run, request.user)
    except actions.ActionError as e:
        messages.error(request, e.message)
        return redirect("run", run_id=run_id)
    messages.info(request, f"Run {run_id} deleted.")
    return redirect("runs")
