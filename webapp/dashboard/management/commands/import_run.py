"""`python manage.py import_run DIR [--owner USERNAME] [--name NAME]`: a run directory the CLI
wrote (`python -m trainer run --out DIR`) becomes an ended dashboard run, with its charts,
samples, timeline, events and checkpoints (resumable from the dashboard). See
webapp/dashboard/actions/imports.py."""
from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from webapp.dashboard import actions


class Command(BaseCommand):
    help = "Import a run directory written by `python -m trainer run` as a dashboard run."

    def add_arguments(self, parser):
        parser.add_argument("directory", help="the CLI run's directory (holds config.toml, metrics.jsonl ...)")
        parser.add_argument("--owner", help="the user who owns the run (default: the only superuser)")
        parser.add_argument("--name", help="the run's name (default: the directory's name)")

    def handle(self, *args, **opts):
        owner = self._owner(opts["owner"])
        try:
            done = actions.import_run_dir(owner, opts["directory"], opts["name"])
        except actions.ActionError as e:
            detail = "".join(f"\n  {k}: {v}" for k, v in e.errors.items())
            raise CommandError(e.message + (detail if len(e.errors) > 1 else "")) from None
        for w in done.warnings:
            self.stderr.write(f"warning: {w}")
        run = done.run
        self.stdout.write(f"imported as run #{run.pk} {run.name!r}: {run.status}, step {run.step}"
                          f"/{run.max_steps}, owner {owner.get_username()}")

    @staticmethod
    def _owner(username: str | None):
        users = get_user_model().objects
        if username:
            user = users.filter(username=username).first()
            if user is None:
                raise CommandError(f"no user {username!r}")
            return user
        supers = list(users.filter(is_superuser=True)[:2])
        if len(supers) != 1:
            raise CommandError("name the run's owner with --owner USERNAME"
                               + (" (there is no superuser)" if not supers else " (there are several superusers)"))
        return supers[0]
