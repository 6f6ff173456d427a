"""`python manage.py export_run ID --format csv|json|toml|html|samples_csv [-o FILE]`: a run's
metrics (full resolution; JSON with the rollout samples), its config, a self-contained HTML report
(Plotly inlined; opens offline) or its rollout samples as CSV."""
from __future__ import annotations

import json
import sys

from django.core.management.base import BaseCommand, CommandError

from webapp.dashboard.models import Run
from webapp.dashboard.reports import exports


class Command(BaseCommand):
    help = "Export a run: metrics as CSV or JSON, the config as TOML, or an offline HTML report."

    def add_arguments(self, parser):
        parser.add_argument("run_id", type=int)
        parser.add_argument("--format", choices=["csv", "json", "toml", "html", "samples_csv"], default="json")
        parser.add_argument("-o", "--output", help="file to write (default: standard output)")

    def handle(self, *args, **opts):
        run = Run.objects.select_related("owner").filter(pk=opts["run_id"]).first()
        if run is None:
            raise CommandError(f"no run {opts['run_id']}")
        fmt = opts["format"]
        if fmt == "csv":
            text = exports.export_csv(run)
        elif fmt == "json":
            text = json.dumps(exports.export_json(run), default=str, indent=1)
        elif fmt == "samples_csv":
            text = exports.export_samples_csv(run)
        elif fmt == "toml":
            text = exports.export_toml(run)
        else:
            text = exports.export_html(run)
        if opts["output"]:
            with open(opts["output"], "w", encoding="utf-8") as f:
                f.write(text)
            self.stderr.write(f"wrote {opts['output']} ({len(text.encode()):,} bytes)")
        else:
            sys.stdout.write(text)
