"""`make run`: migrate, make sure the admin user exists, start the ASGI server (daphne) and a
Celery training worker, sweep stale runs every RLPILOT_SWEEP_S (its own timer: the local
stand-in for Celery beat), print the URL, and stop everything cleanly on Ctrl-C."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand

from webapp import vardir
from webapp.dashboard import actions
from webapp.dashboard.models import LIVE, Desired, Run, Status
from webapp.dashboard.worker import sweep


def worker_command(concurrency: int | None = None, loglevel: str = "info", queues: list[str] | None = None,
                   name: str | None = None) -> list[str]:
    """A Celery worker consuming `queues` (default: the training queue). On another machine the
    same command, with DATABASE_URL and REDIS_URL pointing at the shared services, adds a worker
    (docs/operations.md: "Production layout" and adding a worker machine)."""
    queues = queues or [settings.TRAINING_QUEUE]
    name = name or f"{'+'.join(queues)}-{os.getpid()}"
    return [sys.executable, "-m", "celery", "-A", "webapp", "worker", "-Q", ",".join(queues),
            "--pool", "prefork", "-c", str(concurrency or settings.CELERY_WORKER_CONCURRENCY),
            "--prefetch-multiplier", "1", "-n", f"{name}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", loglevel]


def server_command(host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "daphne", "-b", host, "-p", str(port), "webapp.asgi:application"]


class Command(BaseCommand):
    help = ("Run the dashboard: database migrations, admin user, ASGI server, a Celery worker and "
            "the stale-run sweep.")

    def add_arguments(self, parser):
        parser.add_argument("--host", default=os.environ.get("RLPILOT_HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("RLPILOT_PORT", "8000")))
        parser.add_argument("--no-worker", action="store_true", help="start only the web server")
        parser.add_argument("--queues", default="",
                            help="comma-separated Celery queues the local worker consumes (default: "
                                 "every queue in RLPILOT_QUEUES, so a single machine runs everything)")
        parser.add_argument("--stop-timeout", type=float, default=20.0,
                            help="seconds to wait for running runs to stop at Ctrl-C")

    def handle(self, *args, **opts):
        # var/ (SQLite, the filesystem broker's folders) and the local secret key, before the
        # server and the worker start and read them (the settings create nothing at import)
        vardir.ensure_var_dirs()
        vardir.ensure_secret_key()
        db = settings.DATABASES["default"]
        mode = ("PostgreSQL" if "postgresql" in db["ENGINE"] else f"SQLite (WAL) {db['NAME']}")
        broker = "Redis" if settings.REDIS_URL else f"filesystem broker {settings.CELERY_DIR}"
        self.stdout.write(f"database: {mode}; Celery broker: {broker}; channel layer: "
                          f"{'channels_redis' if settings.REDIS_URL else 'in-memory (consumers poll)'}")
        call_command("migrate", interactive=False, verbosity=0)
        self.ensure_admin()
        n = sweep.mark_stale_runs(force=True)
        if n:
            self.stdout.write(f"{n} run(s) whose worker was gone are now 'interrupted' (resume them from the page)")
        # with nobody watching, a run whose worker dies becomes interrupted within
        # RLPILOT_HEARTBEAT_TIMEOUT_S + RLPILOT_SWEEP_S (production: Celery beat, see settings)
        sweeper = sweep.Sweeper(settings.SWEEP_S).start()

        env = dict(os.environ)
        procs: list[tuple[str, subprocess.Popen]] = []
        # new sessions: Ctrl-C reaches only this process, which stops the children in order
        procs.append(("web", subprocess.Popen(server_command(opts["host"], opts["port"]), env=env,
                                              start_new_session=True)))
        if not opts["no_worker"]:
            queues = [q.strip() for q in opts["queues"].split(",") if q.strip()] or list(settings.RLPILOT_QUEUES)
            unknown = [q for q in queues if q not in settings.RLPILOT_QUEUES]
            if unknown:
                self.stderr.write(f"note: queue(s) {', '.join(unknown)} are not in RLPILOT_QUEUES; "
                                  "the launch form will not offer them")
            self.stdout.write(f"worker consumes: {', '.join(queues)}")
            procs.append(("worker", subprocess.Popen(worker_command(queues=queues), env=env,
                                                     start_new_session=True)))
        host = "127.0.0.1" if opts["host"] in ("0.0.0.0", "::") else opts["host"]
        self.stdout.write(self.style.SUCCESS(f"rlpilot dashboard: http://{host}:{opts['port']}/  "
                                             "(Ctrl-C stops everything)"))
        stopping = {"flag": False}

        def on_signal(signum, frame):
            stopping["flag"] = True

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        try:
            while not stopping["flag"]:
                for name, p in procs:
                    if p.poll() is not None:
                        self.stderr.write(f"the {name} process exited with {p.returncode}; stopping")
                        stopping["flag"] = True
                time.sleep(0.5)
        finally:
            sweeper.stop()   # before the shutdown: it marks what did not stop in time itself
            self.shutdown(procs, opts["stop_timeout"])

    def ensure_admin(self):
        User = get_user_model()
        if User.objects.filter(username="admin").exists():
            pw = os.environ.get("RLPILOT_ADMIN_PASSWORD")
            if pw:
                u = User.objects.get(username="admin")
                if not u.check_password(pw):
                    u.set_password(pw)
                    u.save(update_fields=["password"])
            return
        pw = os.environ.get("RLPILOT_ADMIN_PASSWORD")
        generated = not pw
        if generated:
            pw = secrets.token_urlsafe(12)
        User.objects.create_superuser("admin", "", pw)
        if generated:
            self.stdout.write(self.style.WARNING(f"created user 'admin' with password: {pw}  "
                                                 "(shown once; set RLPILOT_ADMIN_PASSWORD to choose it)"))
        else:
            self.stdout.write("created user 'admin' (password from RLPILOT_ADMIN_PASSWORD)")

    def shutdown(self, procs, timeout: float):
        self.stdout.write("stopping: asking running runs to stop at their next step boundary…")
        live = list(Run.objects.filter(status__in=[Status.RUNNING, Status.PAUSED]).values_list("id", flat=True))
        for rid in live:
            actions.set_status(rid, Status.STOPPING, only_from=[Status.RUNNING, Status.PAUSED],
                               desired=Desired.STOP)
        deadline = time.monotonic() + timeout
        while live and time.monotonic() < deadline:
            if not Run.objects.filter(pk__in=live, status__in=LIVE).exists():
                break
            time.sleep(0.5)
        for _name, p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)   # daphne: graceful; celery: warm shutdown
        deadline = time.monotonic() + 15
        for name, p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stderr.write(f"{name} did not stop in time; killing it")
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        for rid in Run.objects.filter(pk__in=live, status__in=LIVE).values_list("id", flat=True):
            actions.set_status(rid, Status.INTERRUPTED, only_from=LIVE,
                               error="the server was stopped before the run finished stopping")
        self.stdout.write("stopped.")
