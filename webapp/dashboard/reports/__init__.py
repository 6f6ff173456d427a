"""Reports, read-only: one run's summary, events and pilot history (summary.py), the comparison of
runs (comparison.py), the pilot's advice and APRIL's rules of thumb on a run (advice.py), its cost
and forecast (cost.py), the estimate of a run to launch (estimate.py), and the exports: CSV, JSON,
TOML, offline HTML (exports.py)."""
