"""The JSON API (endpoints.py; the table in docs/dashboard.md): the same actions as the pages,
with session or token authentication."""
