from django.urls import path

from webapp.dashboard import api, views

urlpatterns = [
    path("", views.runs_page, name="runs"),
    path("runs/<int:run_id>/", views.run_page, name="run"),
    path("runs/<int:run_id>/delete", views.run_delete, name="run-delete"),
    path("runs/<int:run_id>/report/", views.report_page, name="run-report"),
    path("runs/<int:run_id>/annotate", views.run_annotate, name="run-annotate"),
    path("runs/<int:run_id>/checkpoints/<int:step>", views.run_checkpoint, name="run-checkpoint"),
    path("compare/", views.compare_page, name="compare"),
    path("api/knobs", api.knobs),
    path("api/presets", api.presets),
    path("api/runs", api.runs),
    path("api/runs/<int:run_id>", api.run_detail),
    path("api/runs/<int:run_id>/metrics", api.run_metrics),
    path("api/runs/<int:run_id>/export", api.run_export),
    path("api/runs/<int:run_id>/knobs", api.run_knobs),
    path("api/runs/<int:run_id>/stop", api.run_stop),
    path("api/runs/<int:run_id>/pause", api.run_pause),
    path("api/runs/<int:run_id>/resume", api.run_resume),
    path("api/runs/<int:run_id>/kill", api.run_kill),
]
