"""Django's SQLite backend (ENGINE "webapp.backends.sqlite3"), which creates the database file's
folder (the embedded setup's var/, RLPILOT_VAR_DIR) when it opens its first connection: the
folder is made when something needs the database, never when the settings are imported.
Everything else is Django's backend unchanged."""
from __future__ import annotations

from pathlib import Path

from django.db.backends.sqlite3 import base


class DatabaseWrapper(base.DatabaseWrapper):
    def get_new_connection(self, conn_params):
        name = str(conn_params.get("database") or "")
        # a file path (not ":memory:" nor a "file:..." URI, e.g. Django's in-memory test database)
        if name and name != ":memory:" and not name.startswith("file:"):
            Path(name).parent.mkdir(parents=True, exist_ok=True)
        return super().get_new_connection(conn_params)
