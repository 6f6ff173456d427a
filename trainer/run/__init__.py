"""One training run, start to stop: the step loop (runner.py) and what it is built from (build.py,
step_record.py), the step boundary (boundary.py, controls.py), checkpoints, resume, fork, evaluation."""
