"""A run's accounts, kept from what it recorded (trainer/observe/): what it cost (cost.py:
device-hours by process and phase, priced), the rest forecast from its pace (forecast.py), a
configured run estimated before launch from the runs recorded (estimate.py), a run read as these
accounts read it (run_files.py: a run directory or a dashboard export), and the rollout
inspector's record of the samples a step kept (inspector.py)."""
