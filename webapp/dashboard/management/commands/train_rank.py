"""`python manage.py train_rank RUN_ID [--resume]`: one training process of a multi-process run,
as torchrun runs it on every rank (tasks.train_under_torchrun starts torchrun; docs/dashboard.md).

Rank 0 does what a one-process run does in the Celery worker (tasks.train_here: the database
sink and control source, the heartbeat, the run's end with its summary or error); the other
ranks run the same Runner, which gives them a null sink and null controls (rank 0 reads the
controls; each step's config comes with their share of the update). Exits 0 when the run ended as it should (finished or
stopped), non-zero otherwise, so torchrun stops the other ranks."""
from __future__ import annotations

import logging

from django.core.management.base import BaseCommand, CommandError
from django.db import close_old_connections

from trainer import config as config_mod
from trainer.cluster import distributed, launch
from trainer.run.runner import Runner
from webapp.dashboard.actions import run_dir
from webapp.dashboard.models import Run, Status
from webapp.dashboard.worker import tasks

log = logging.getLogger(__name__)


class Command(BaseCommand):
    help = "One torchrun rank of a multi-process run (started by the Celery worker, not by hand)."

    def add_arguments(self, parser):
        parser.add_argument("run_id", type=int)
        parser.add_argument("--resume", action="store_true", help="resume from the run's latest checkpoint")

    def handle(self, *args, **opts):
        launch.die_with_launcher()   # torchrun SIGKILLed: no rank stays behind
        rid = opts["run_id"]
        config = Run.objects.filter(pk=rid).values_list("config", flat=True).first()
        if config is None:
            raise CommandError(f"no run {rid}")
        cfg = config_mod.from_dict(config)
        world = distributed.init(cfg.model.device)
        if world.size != cfg.cluster.train_procs:
            raise CommandError(f"run {rid} asks for cluster.train_procs={cfg.cluster.train_procs} "
                               f"but torchrun started {world.size} processes")
        ok = False
        try:
            ok = self.train(rid, cfg, world.is_main, opts["resume"])
        finally:
            close_old_connections()
            distributed.destroy(sync=ok)   # a failed rank may be alone: no barrier then
        distributed.exit_process(0 if ok else 1)

    def train(self, rid: int, cfg, main: bool, resume: bool) -> bool:
        if main:
            return tasks.train_here(rid, cfg, run_dir(rid), resume) != Status.FAILED
        with Runner(cfg, run_dir(rid), resume=resume, log=log.debug) as runner:
            runner.run()
        return True
