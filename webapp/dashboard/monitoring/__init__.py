"""Watching the dashboard from outside: Prometheus `GET /metrics` and `GET /health`
(docs/operations.md, "Prometheus and health checks"). Both are off unless RLPILOT_METRICS_ENABLED
and need the bearer token RLPILOT_METRICS_TOKEN (access.py)."""
