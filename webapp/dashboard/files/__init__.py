"""Run directories on disk that come from outside the dashboard: reading one the CLI wrote
(run_files.py) and unpacking an uploaded .zip or .tar.gz of one without trusting it (archives.py)."""
