"""One training run, start to stop: the step loop (runner.py) and what it is built from (parts.py,
build.py, engines.py, step_record.py), every rank's part in it (training_ranks.py), the step boundary
(boundary.py, controls.py), checkpoints, resume, fork, evaluation, and the built-in model's
supervised warm-up (warmup.py: a run of its own, before RL)."""
