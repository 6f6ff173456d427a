"""Django's SQLite backend, creating the database's folder when it first opens it (see base.py)."""
