"""Django settings, read from the environment with safe defaults for local use.

Embedded default (nothing installed): SQLite in WAL mode under var/, a Celery broker on the
filesystem (var/celery/) and an in-process channel layer (consumers poll the database).
With DATABASE_URL (PostgreSQL) and REDIS_URL: PostgreSQL, Redis as the Celery broker and
channels_redis as the channel layer (consumers wait on a doorbell).

Importing this module creates no folder and writes no file: it only names paths. What the
embedded setup keeps under RLPILOT_VAR_DIR is created where it is needed (webapp/vardir.py).
"""
from __future__ import annotations

import secrets
from pathlib import Path

from webapp.env import database_from_url, env, env_bool, env_float, env_int, env_list, read_secret, sqlite_database

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env("RLPILOT_VAR_DIR", str(BASE_DIR / "var"))).resolve()

DEBUG = env_bool("DEBUG", False)
# SECRET_KEY from the environment; else (local use) the random key kept in var/secret_key so
# sessions survive restarts; else, before the first start wrote that file, a random key for this
# process, which `manage.py serve` and the web server's start keep there (vardir.ensure_secret_key).
SECRET_KEY_FILE = VAR_DIR / "secret_key"
SECRET_KEY = env("SECRET_KEY") or read_secret(SECRET_KEY_FILE)
SECRET_KEY_GENERATED = not SECRET_KEY
if SECRET_KEY_GENERATED:
    SECRET_KEY = secrets.token_urlsafe(50)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "webapp.dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "webapp.urls"
ASGI_APPLICATION = "webapp.asgi.application"
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "DIRS": [BASE_DIR / "templates"],
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]

# --- database ------------------------------------------------------------------------------------
DATABASE_URL = env("DATABASE_URL")
if DATABASE_URL:
    DATABASES = {"default": database_from_url(DATABASE_URL)}
else:
    DATABASES = {"default": sqlite_database(str(VAR_DIR / "rlpilot.sqlite3"))}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # tests: a file (not :memory:) so that workers and servers in other processes share it
    DATABASES["default"]["TEST"] = {"NAME": env("RLPILOT_TEST_DB_NAME",
                                                str(VAR_DIR / "test-rlpilot.sqlite3"))}
elif env("RLPILOT_TEST_DB_NAME"):
    DATABASES["default"]["TEST"] = {"NAME": env("RLPILOT_TEST_DB_NAME")}
EMBEDDED_DB = DATABASES["default"]["ENGINE"].endswith("sqlite3")   # webapp.backends.sqlite3
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- channel layer and Celery ---------------------------------------------------------------------
REDIS_URL = env("REDIS_URL")
CHANNEL_PREFIX = env("RLPILOT_CHANNEL_PREFIX", "rlpilot")
if REDIS_URL:
    CHANNEL_LAYERS = {"default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        # redis-py 8's default socket timeout races channels_redis's 5 s blocking pops
        # ("Timeout reading from ...", django/channels_redis#422): give reads more time.
        "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 30, "socket_connect_timeout": 5}],
                   "prefix": CHANNEL_PREFIX, "capacity": 1000, "expiry": 30},
    }}
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
# True when the channel layer reaches other processes; otherwise consumers poll the database.
CROSS_PROCESS_DOORBELL = bool(REDIS_URL)
WS_POLL_INTERVAL_S = env_float("RLPILOT_WS_POLL_S", 0.2 if not REDIS_URL else 2.0)
# An open socket re-reads its session and user this often (and before every control message):
# logged out, deactivated or changed rights close it.
WS_USER_RECHECK_S = env_float("RLPILOT_WS_USER_RECHECK_S", 10.0)
# The channel layer down (Redis unreachable): sockets stay open and poll the database this often
# (tell the client a `stream` frame), re-joining their group every CHANNEL_LAYER_RETRY_S; one call
# to the layer waits at most CHANNEL_LAYER_TIMEOUT_S. The trainer's doorbell drops its rings
# while the layer is down and tries again every CHANNEL_LAYER_RETRY_S.
WS_FALLBACK_POLL_S = env_float("RLPILOT_WS_FALLBACK_POLL_S", 1.0)
CHANNEL_LAYER_RETRY_S = env_float("RLPILOT_CHANNEL_LAYER_RETRY_S", 2.0)
CHANNEL_LAYER_TIMEOUT_S = env_float("RLPILOT_CHANNEL_LAYER_TIMEOUT_S", 3.0)

TRAINING_QUEUE = env("RLPILOT_TRAINING_QUEUE", "training")
# The queues a run may be sent to (one per kind of worker machine, e.g. "gpu-h200"); the first
# entry is the default. A worker consumes one or more of them: `celery -A webapp worker -Q gpu-h200`.
RLPILOT_QUEUES = env_list("RLPILOT_QUEUES", [TRAINING_QUEUE])
if TRAINING_QUEUE not in RLPILOT_QUEUES:
    RLPILOT_QUEUES.insert(0, TRAINING_QUEUE)
CELERY_TASK_DEFAULT_QUEUE = TRAINING_QUEUE
CELERY_TASK_IGNORE_RESULT = True
CELERY_RESULT_BACKEND = None
# One run per worker process; never fetch a second task while one is running, and acknowledge
# a task when it starts: a multi-hour run is never redelivered and restarted from scratch behind
# the user's back (a lost worker shows up as "interrupted" instead, and the user resumes it).
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ACKS_LATE = False
CELERY_TASK_REJECT_ON_WORKER_LOST = False
CELERY_WORKER_CONCURRENCY = env_int("RLPILOT_WORKER_CONCURRENCY", 1)
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_DIR = VAR_DIR / "celery"
if REDIS_URL:
    CELERY_BROKER_URL = REDIS_URL
    CELERY_WORKER_DISABLE_PREFETCH = True   # (Redis only) fetch a task only when a process is free
    CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 7 * 24 * 3600}
else:
    # The filesystem broker needs no server; absolute folders shared by every process make
    # remote control (ping, revoke(terminate=True)) work with the prefork pool. They are created
    # when a worker starts or a task is sent (webapp/celery.py, webapp/vardir.py).
    CELERY_BROKER_URL = "filesystem://"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(CELERY_DIR / "queue"),
        "data_folder_out": str(CELERY_DIR / "queue"),
        "processed_folder": str(CELERY_DIR / "processed"),
        "control_folder": str(CELERY_DIR / "control"),
        "store_processed": False,
        "polling_interval": 0.25,
    }

# --- runs ----------------------------------------------------------------------------------------
RUNS_DIR = Path(env("RLPILOT_RUNS_DIR", str(VAR_DIR / "runs"))).resolve()
HEARTBEAT_S = env_float("RLPILOT_HEARTBEAT_S", 5.0)
HEARTBEAT_TIMEOUT_S = env_float("RLPILOT_HEARTBEAT_TIMEOUT_S", 30.0)
CHART_MAX_POINTS = env_int("RLPILOT_CHART_MAX_POINTS", 1000)
# rollout samples kept per run (the inspector); past it the oldest steps are thinned (0 = no cap)
SAMPLES_PER_RUN = env_int("RLPILOT_SAMPLES_PER_RUN", 20000)
# importing a CLI run directory from the runs page (an archive, actions/imports.py): the largest
# upload, and the most bytes and entries it may unpack to (each JSONL file also obeys
# RLPILOT_MAX_DATA_BYTES)
MAX_IMPORT_BYTES = env_int("RLPILOT_MAX_IMPORT_BYTES", 2 * 2**30)
MAX_IMPORT_FILES = env_int("RLPILOT_MAX_IMPORT_FILES", 10000)

# --- the stale-run sweep (webapp/dashboard/worker/sweep.py) ----------------------------------------
# A live run without a heartbeat for HEARTBEAT_TIMEOUT_S becomes `interrupted`: checked every
# SWEEP_S seconds with nobody watching (production: Celery beat sends the sweep to SWEEP_QUEUE,
# which a worker on the web machine consumes -- `celery -A webapp beat` and
# `celery -A webapp worker -Q rlpilot-sweep`; training workers are busy with their runs and never
# consume it. Locally: `manage.py serve`'s own timer), and lazily by pages, the API and sockets.
SWEEP_S = env_float("RLPILOT_SWEEP_S", min(5.0, max(0.5, HEARTBEAT_TIMEOUT_S / 3)))
SWEEP_QUEUE = env("RLPILOT_SWEEP_QUEUE", "rlpilot-sweep")
# Celery task names are stable identifiers (a queued task carries its name), kept from when the
# tasks module was webapp/dashboard/tasks.py; webapp/dashboard/worker/tasks.py registers them.
SWEEP_TASK = "webapp.dashboard.tasks.sweep_stale_runs"
CELERY_BEAT_SCHEDULE = {"sweep-stale-runs": {
    "task": SWEEP_TASK, "schedule": SWEEP_S,
    # a sweep nobody took in time is dropped, so a sweep worker that was down does not run a
    # backlog of them when it comes back
    "options": {"queue": SWEEP_QUEUE, "expires": max(10.0, 2 * SWEEP_S)},
}}
# beat keeps its schedule in memory (one fixed interval: nothing worth a schedule file)
CELERY_BEAT_SCHEDULER = "celery.beat:Scheduler"
CELERY_TASK_ROUTES = {SWEEP_TASK: {"queue": SWEEP_QUEUE},
                      "webapp.dashboard.tasks.*": {"queue": TRAINING_QUEUE}}

# --- alerts (webapp/dashboard/worker/alerts.py): evaluated as a run's metrics arrive ----------------
ALERT_KL_MAX = env_float("RLPILOT_ALERT_KL_MAX", 0.5)              # actor/kl above this
# for this many steps in a row: one step's KL estimate spikes ~2.5x its level on a healthy run
ALERT_KL_HIGH_STEPS = env_int("RLPILOT_ALERT_KL_HIGH_STEPS", 2)
# kl_rising: actor/kl's median over the last WINDOW steps >= FACTOR x its median over the WINDOW
# before, and >= MIN (a learning policy's KL rises too; a runaway doubles)
ALERT_KL_RISE_FACTOR = env_float("RLPILOT_ALERT_KL_RISE_FACTOR", 2.0)
ALERT_KL_RISE_MIN = env_float("RLPILOT_ALERT_KL_RISE_MIN", 0.25)
ALERT_KL_RISE_WINDOW = env_int("RLPILOT_ALERT_KL_RISE_WINDOW", 20)  # steps
if env("RLPILOT_ALERT_KL_RISE"):   # the per-step slope it set fired on healthy runs
    raise ValueError("RLPILOT_ALERT_KL_RISE (a KL slope per step) is gone: set "
                     "RLPILOT_ALERT_KL_RISE_FACTOR and RLPILOT_ALERT_KL_RISE_MIN (docs/dashboard.md)")
# mismatch_high: the engine's log-probabilities far from the trainer's (trainer/algo/
# rollout_correction.py). mismatch/kl (k3, token mean): an fp32 engine against an fp32 trainer
# measures ~1e-9, a bf16 engine against an fp32 trainer ~5e-5 on the built-in model: 1e-2 is
# ~200x that healthy bf16 figure (room for larger models and longer sequences): what it catches
# is a mismatch of another order (an engine on other weights, a broken kernel). Asynchronous
# and APRIL runs are judged by mismatch/age0/kl: their mismatch/kl adds the policy's drift since
# stale tokens were sampled (0.012 at a step of a healthy tiny async run).
# mismatch/outside_band_ratio: a healthy bf16 run has no token outside the default [0.5, 2]
# (its largest |Δ log p| is ~0.2 < ln 2); 5% of tokens past a factor of 2 is a real problem (in
# an asynchronous run stale tokens' drift counts too: a correction would drop or cap them).
ALERT_MISMATCH_KL_MAX = env_float("RLPILOT_ALERT_MISMATCH_KL_MAX", 0.01)
ALERT_MISMATCH_OUTSIDE_MAX = env_float("RLPILOT_ALERT_MISMATCH_OUTSIDE_MAX", 0.05)
ALERT_COLLAPSE_RATIO = env_float("RLPILOT_ALERT_COLLAPSE_RATIO", 0.95)  # all_wrong share "near 1"
ALERT_COLLAPSE_STEPS = env_int("RLPILOT_ALERT_COLLAPSE_STEPS", 5)       # for this many steps
# a raised alert clears only after its condition has been false for this many steps in a row, so
# a value hovering at a threshold gives one alert, not an alert and a clear every other step
ALERT_CLEAR_STEPS = env_int("RLPILOT_ALERT_CLEAR_STEPS", 3)
# stalled: no step finished for ALERT_STALL_FACTOR x the run's median step time, and at least
# ALERT_STALL_MIN_S (evaluated by the worker's heartbeat thread, so also when nothing is written)
ALERT_STALL_FACTOR = env_float("RLPILOT_ALERT_STALL_FACTOR", 5.0)
ALERT_STALL_MIN_S = env_float("RLPILOT_ALERT_STALL_MIN_S", 60.0)
# an evaluation or a checkpoint between steps is no stall, for up to this long
ALERT_STALL_PHASE_MAX_S = env_float("RLPILOT_ALERT_STALL_PHASE_MAX_S", 1800.0)
# (the heartbeat alert uses RLPILOT_HEARTBEAT_TIMEOUT_S above)

# --- Prometheus /metrics and /health (webapp/dashboard/monitoring/) --------------------------------
# Off by default (both answer 404). On, they need `Authorization: Bearer <RLPILOT_METRICS_TOKEN>`;
# enabling them without a token is refused unless RLPILOT_METRICS_ALLOW_NO_TOKEN says so (e.g. a
# port only the scraper reaches): runs' names and owners are in /metrics.
RLPILOT_METRICS_ENABLED = env_bool("RLPILOT_METRICS_ENABLED", False)
RLPILOT_METRICS_TOKEN = env("RLPILOT_METRICS_TOKEN").strip()
RLPILOT_METRICS_ALLOW_NO_TOKEN = env_bool("RLPILOT_METRICS_ALLOW_NO_TOKEN", False)
METRICS_TOKEN_MIN_LEN = 16
if RLPILOT_METRICS_TOKEN and len(RLPILOT_METRICS_TOKEN) < METRICS_TOKEN_MIN_LEN:
    raise ValueError(f"RLPILOT_METRICS_TOKEN: {len(RLPILOT_METRICS_TOKEN)} characters; expected at least "
                     f"{METRICS_TOKEN_MIN_LEN} (e.g. `openssl rand -hex 32`)")
if RLPILOT_METRICS_ENABLED and not RLPILOT_METRICS_TOKEN and not RLPILOT_METRICS_ALLOW_NO_TOKEN:
    raise ValueError("RLPILOT_METRICS_ENABLED=true needs RLPILOT_METRICS_TOKEN (the bearer token the "
                     "scraper sends), or RLPILOT_METRICS_ALLOW_NO_TOKEN=true to serve /metrics and "
                     "/health to anyone who reaches them")
# /health: how long it waits for a Celery worker's ping reply when no live run's heartbeat is fresh
RLPILOT_HEALTH_PING_TIMEOUT_S = env_float("RLPILOT_HEALTH_PING_TIMEOUT_S", 2.0)
if not 0 < RLPILOT_HEALTH_PING_TIMEOUT_S <= 60:
    raise ValueError(f"RLPILOT_HEALTH_PING_TIMEOUT_S={RLPILOT_HEALTH_PING_TIMEOUT_S:g}: expected seconds in (0, 60]")

# --- auth and security ---------------------------------------------------------------------------
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "runs"
LOGOUT_REDIRECT_URL = "login"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", False)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", not DEBUG and SECURE_SSL_REDIRECT)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", not DEBUG and SECURE_SSL_REDIRECT)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", SECURE_HSTS_SECONDS > 0)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)
if env_bool("BEHIND_TLS_PROXY", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
X_FRAME_OPTIONS = "DENY"

# --- static files --------------------------------------------------------------------------------
STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = Path(env("STATIC_ROOT", str(VAR_DIR / "static"))).resolve()
# The ASGI app serves static files itself (local use, offline: Plotly comes from static/vendor).
SERVE_STATIC = env_bool("RLPILOT_SERVE_STATIC", True)

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env("LOG_LEVEL", "INFO")},
    "loggers": {"django.channels.server": {"level": "WARNING"}},
}

# --- hardening (webapp/dashboard/access/: validation.py, policy.py, throttle.py) --------------------
# The SGLang servers a run may use (comma-separated URLs). Empty: the SGLang engine is refused.
RLPILOT_SGLANG_URLS = env_list("RLPILOT_SGLANG_URLS", [])
# model.path / data.path / data.eval_path of a run launched from the web must resolve (symlinks
# and ".." followed) inside one of these folders (comma-separated); model.path "builtin" (or another
# shipped model, "builtin-tools": trainer/assets) always may. Default: the runs folder (checkpoints)
# and var/models for models, var/data for data files.
RLPILOT_MODEL_ROOTS = [Path(p).resolve() for p in env_list(
    "RLPILOT_MODEL_ROOTS", [str(RUNS_DIR), str(VAR_DIR / "models")])]
RLPILOT_DATA_ROOTS = [Path(p).resolve() for p in env_list("RLPILOT_DATA_ROOTS", [str(VAR_DIR / "data")])]
# The most training processes (cluster.train_procs: torchrun ranks on the worker's machine) a run
# may ask for. 0: the worker's GPU count when the model runs on CUDA, else its CPU count (checked
# by the worker only; the web machine's hardware says nothing about the worker's).
RLPILOT_MAX_TRAIN_PROCS = env_int("RLPILOT_MAX_TRAIN_PROCS", 0)
# The most generation processes (cluster.gen_procs) a run may ask for: each holds the model twice
# (its own copy and the shared buffer the weights arrive in).
RLPILOT_MAX_GEN_PROCS = env_int("RLPILOT_MAX_GEN_PROCS", 4)
# Login throttling: this many failed logins for one username from one address within the window
# (seconds, from the first failure) and further attempts wait for the window's end. 0 = off.
RLPILOT_LOGIN_MAX_FAILURES = env_int("RLPILOT_LOGIN_MAX_FAILURES", 5)
RLPILOT_LOGIN_WINDOW_S = env_int("RLPILOT_LOGIN_WINDOW_S", 300)
# how many reverse proxies in front of daphne append the client's address to X-Forwarded-For:
# the login throttle then keys on that entry (0: the socket's peer, REMOTE_ADDR)
RLPILOT_TRUSTED_PROXIES = env_int("RLPILOT_TRUSTED_PROXIES", 0)
AUTHENTICATION_BACKENDS = ["webapp.dashboard.access.throttle.ThrottledModelBackend"]
# Runs one (non-staff) user may have queued, running, paused or stopping at once. 0 = no limit.
RLPILOT_MAX_ACTIVE_RUNS_PER_USER = env_int("RLPILOT_MAX_ACTIVE_RUNS_PER_USER", 8)
# Floods (0 = no limit): knob changes waiting for one run's next step boundary, knob changes one
# user may ask for a minute, exports one user may have in progress at once, WebSockets one user
# may hold open on one web process.
RLPILOT_MAX_PENDING_KNOB_CHANGES = env_int("RLPILOT_MAX_PENDING_KNOB_CHANGES", 10)
RLPILOT_KNOB_CHANGES_PER_MINUTE = env_int("RLPILOT_KNOB_CHANGES_PER_MINUTE", 60)
RLPILOT_MAX_EXPORTS_PER_USER = env_int("RLPILOT_MAX_EXPORTS_PER_USER", 2)
RLPILOT_MAX_SOCKETS_PER_USER = env_int("RLPILOT_MAX_SOCKETS_PER_USER", 20)
# What a device-hour costs (docs/cost.md): 0 = no price, the report's cost is in hours only.
RLPILOT_RATE_GPU_HOUR = env_float("RLPILOT_RATE_GPU_HOUR", 0.0)
RLPILOT_RATE_CPU_CORE_HOUR = env_float("RLPILOT_RATE_CPU_CORE_HOUR", 0.0)
# An estimate with no past run of the same shape calibrates the run on a worker for this long.
RLPILOT_ESTIMATE_SECONDS = env_float("RLPILOT_ESTIMATE_SECONDS", 30.0)
if not 0 < RLPILOT_ESTIMATE_SECONDS <= 3600:
    raise ValueError(f"RLPILOT_ESTIMATE_SECONDS={RLPILOT_ESTIMATE_SECONDS:g}: expected seconds in (0, 3600]")
# The cache holds the login failure counts: Redis when there is one (shared by every web
# process; short timeouts, and the throttle lets logins through while it is down), else memory.
if REDIS_URL:
    CACHES = {"default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL,
        "KEY_PREFIX": CHANNEL_PREFIX,
        "OPTIONS": {"socket_timeout": 2, "socket_connect_timeout": 2},
    }}
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache",
                          "LOCATION": "rlpilot"}}
