"""Database backends of the project (see sqlite3/)."""
