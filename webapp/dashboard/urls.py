from django.urls import path, re_path, register_converter

from webapp.dashboard.api import base as api_base
from webapp.dashboard.api import endpoints as api
from webapp.dashboard.pages import views


class RunIdConverter:
    """<id:...> in URLs: 1 to 18 digits, so an id always fits the database's 64-bit integers (a
    longer one is a 404, not an overflow)."""
    regex = "[0-9]{1,18}"

    def to_python(self, value: str) -> int:
        return int(value)

    def to_url(self, value) -> str:
        return str(value)


register_converter(RunIdConverter, "id")

urlpatterns = [
    path("", views.runs_page, name="runs"),
    path("runs/import", views.run_import, name="run-import"),
    path("runs/<id:run_id>/", views.run_page, name="run"),
    path("runs/<id:run_id>/delete", views.run_delete, name="run-delete"),
    path("runs/<id:run_id>/report/", views.report_page, name="run-report"),
    path("runs/<id:run_id>/annotate", views.run_annotate, name="run-annotate"),
    path("runs/<id:run_id>/checkpoints/<id:step>", views.run_checkpoint, name="run-checkpoint"),
    path("runs/<id:run_id>/fork", views.fork_page, name="run-fork"),
    path("compare/", views.compare_page, name="compare"),
    path("api/knobs", api.knobs),
    path("api/presets", api.presets),
    path("api/runs", api.runs),
    path("api/estimates", api.estimates),
    path("api/estimates/<id:estimate_id>", api.estimate_detail),
    path("api/runs/<id:run_id>", api.run_detail),
    path("api/runs/<id:run_id>/metrics", api.run_metrics),
    path("api/runs/<id:run_id>/timeline", api.run_timeline),
    path("api/runs/<id:run_id>/advice", api.run_advice),
    path("api/runs/<id:run_id>/advice/dismiss", api.run_advice_dismiss),
    path("api/runs/<id:run_id>/samples", api.run_samples),
    path("api/runs/<id:run_id>/samples/<id:sample_id>", api.run_sample),
    path("api/runs/<id:run_id>/export", api.run_export),
    path("api/runs/<id:run_id>/knobs", api.run_knobs),
    path("api/runs/<id:run_id>/stop", api.run_stop),
    path("api/runs/<id:run_id>/pause", api.run_pause),
    path("api/runs/<id:run_id>/resume", api.run_resume),
    path("api/runs/<id:run_id>/kill", api.run_kill),
    path("api/runs/<id:run_id>/fork", api.run_fork),
    re_path(r"^api/", api_base.not_found),   # anything else under /api/: a JSON 404
]
