"""What runs in the Celery worker: the tasks (training a run, the stale-run sweep), the trainer's
database sink and control source (telemetry), and the alert rules evaluated as metrics arrive."""
