"""One training run from start to stop: the step loop (runner.py), its collaborators for each rank
role and a resume's state (build.py), a step's metric record (step_record.py), the step boundary
where knob changes, pause and stop land (boundary.py, controls.py), checkpoints and resuming
(checkpoint.py, state.py), forks (fork.py) and held-out evaluation (evaluate.py)."""
