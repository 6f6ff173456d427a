"""Past-run reports, read-only: one run's summary, events and pilot history (summary.py), the
comparison of runs (comparison.py), and the exports: CSV, JSON, TOML, offline HTML (exports.py)."""
