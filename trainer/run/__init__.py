"""One training run from start to stop: the step loop (runner.py), the step boundary where knob
changes, pause and stop land (boundary.py, controls.py), checkpoints and resuming (checkpoint.py,
state.py), forks (fork.py) and held-out evaluation (evaluate.py)."""
