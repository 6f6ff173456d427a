"""Small typed helpers that read settings from the environment (healthchecks-style)."""
from __future__ import annotations

import os
from urllib.parse import parse_qs, unquote, urlparse

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected true or false")


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer") from None


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number") from None


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return list(default)
    return [item.strip() for item in raw.split(",") if item.strip()]


def database_from_url(url: str) -> dict:
    """postgres://user:pass@host:port/name?sslmode=require  or  sqlite:////abs/path.sqlite3"""
    u = urlparse(url)
    if u.scheme in ("postgres", "postgresql", "pgsql"):
        options = {k: v[-1] for k, v in parse_qs(u.query).items()}
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": unquote(u.path.lstrip("/")) or "postgres",
            "USER": unquote(u.username or ""),
            "PASSWORD": unquote(u.password or ""),
            "HOST": u.hostname or "",
            "PORT": str(u.port or ""),
            "OPTIONS": options,
            "CONN_MAX_AGE": 0,
        }
    if u.scheme == "sqlite":
        path = unquote(url[len("sqlite://"):])
        return sqlite_database(path[1:] if path.startswith("//") else path)
    raise ValueError(f"DATABASE_URL={url!r}: expected postgres://... or sqlite:///path")


def read_secret(path) -> str:
    """The text of a secret kept in a file (stripped), or "" when there is none yet. Reads only."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        return ""


def sqlite_database(path: str) -> dict:
    # WAL + IMMEDIATE transactions + a busy timeout: measured to give no "database is locked"
    # with the web process and a worker writing rows every 100 ms (docs/benchmarks.md).
    # Django's SQLite backend, which also creates the database's folder when it first connects
    # (webapp/backends/sqlite3), so the settings need not create it at import.
    return {
        "ENGINE": "webapp.backends.sqlite3",
        "NAME": path,
        "OPTIONS": {
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            "transaction_mode": "IMMEDIATE",
            "timeout": 30,
        },
    }
