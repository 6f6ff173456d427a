"""The local folder (RLPILOT_VAR_DIR, default var/) and what the embedded setup keeps there,
created where it is needed and never when the settings are imported:

- the SQLite database's folder: by the database backend when it first connects
  (webapp/backends/sqlite3);
- the filesystem broker's folders (var/celery/, embedded setup only): `ensure_broker_dirs`, when a
  worker starts and before a task is sent (Celery signals in webapp/celery.py), and by
  `manage.py serve`;
- the local SECRET_KEY file (var/secret_key, when SECRET_KEY is not set): `ensure_secret_key`, by
  `manage.py serve` before it starts the server and the worker, and when the web server starts
  (webapp/asgi.py, webapp/wsgi.py), so sessions survive restarts and every process uses one key.
"""
from __future__ import annotations

import os
from pathlib import Path

from django.conf import settings


def broker_dirs() -> list[Path]:
    """The folders of Celery's filesystem broker (none with Redis)."""
    if not str(getattr(settings, "CELERY_BROKER_URL", "")).startswith("filesystem://"):
        return []
    opts = settings.CELERY_BROKER_TRANSPORT_OPTIONS
    keys = ("data_folder_in", "data_folder_out", "processed_folder", "control_folder")
    return list(dict.fromkeys(Path(opts[k]) for k in keys if opts.get(k)))


def ensure_broker_dirs() -> None:
    for d in broker_dirs():
        d.mkdir(parents=True, exist_ok=True)


def ensure_var_dirs() -> None:
    """var/ and, in the embedded setup, the broker's folders (`manage.py serve`)."""
    Path(settings.VAR_DIR).mkdir(parents=True, exist_ok=True)
    ensure_broker_dirs()


def ensure_secret_key() -> str:
    """Keep the key this process generated (settings.SECRET_KEY_GENERATED: no SECRET_KEY in the
    environment and no key file yet) in settings.SECRET_KEY_FILE, readable by its owner only, so
    the processes started after this one read it. When another process wrote the file first, its
    key wins and this process adopts it (call this before serving a request). Returns the key."""
    if not getattr(settings, "SECRET_KEY_GENERATED", False):
        return settings.SECRET_KEY
    path = Path(settings.SECRET_KEY_FILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(settings.SECRET_KEY)
    try:
        try:
            os.link(tmp, path)   # atomic, and never replaces a key another process kept first
        except FileExistsError:
            raise
        except OSError:          # a filesystem without hard links: create it exclusively
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(settings.SECRET_KEY)
    except FileExistsError:
        kept = path.read_text(encoding="utf-8").strip()
        if kept:
            settings.SECRET_KEY = kept
    finally:
        tmp.unlink(missing_ok=True)
    settings.SECRET_KEY_GENERATED = False
    return settings.SECRET_KEY
