"""The Celery app. Training workers: `celery -A webapp worker -Q <queue>` (docs/operations.md,
"Production layout"). The periodic stale-run sweep: `celery -A webapp beat` (one, anywhere) sends it every
RLPILOT_SWEEP_S to RLPILOT_SWEEP_QUEUE, which one small worker on the web machine consumes
(`celery -A webapp worker -Q rlpilot-sweep -c 1`); see settings.CELERY_BEAT_SCHEDULE."""
import os

from celery import Celery, signals

from webapp import vardir

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

app = Celery("webapp")
app.config_from_object("django.conf:settings", namespace="CELERY")
# the dashboard's tasks live in webapp/dashboard/worker/tasks.py, not in the app's own `tasks` module
app.autodiscover_tasks(["webapp.dashboard.worker"])


@signals.celeryd_init.connect
def _worker_starts(**kwargs) -> None:
    """A worker starts: the embedded setup's broker folders exist before it consumes."""
    vardir.ensure_broker_dirs()


@signals.before_task_publish.connect
def _task_sent(**kwargs) -> None:
    """Before any process (web server, beat, a command) sends a task through the filesystem broker."""
    vardir.ensure_broker_dirs()
