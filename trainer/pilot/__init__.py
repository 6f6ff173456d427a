"""The pilot: rules that read a run's recent metrics and its config and say which knob to move,
by how much and why (docs/pilot.md).

  advice.py      `Advice` and its `Figure`s (the evidence), `propose` (a value inside a knob's range)
  window.py      `Window`: the recent metric rows, read as series (means, trends, shares of steps)
  thresholds.py  `Thresholds`: every rule's threshold, with its default and where it comes from
  staleness.py   eta (async.max_staleness) -- shares its verdict with async.auto_staleness
  april.py       over-sampling, segment limit, response length
  greso.py       GRESO's exploration bounds
  health.py      length hacking, entropy collapse, KL runaway
  mismatch.py    the engine-trainer mismatch: the rollout correction, the engine's precision
  episodes.py    multi-turn runs whose episodes are all single-turn (no silent fallback)
  rules.py       `advise(rows, cfg)`: every rule over the latest window
  `python -m trainer advise RUN_DIR` is trainer/cli/advise.py

Pure logic: no model, no torch, no Django.
"""
