"""What users may send the web app, checked before anything is stored or run.

- Text users type (run names, notes, tags, config strings) must be storable: no NUL (PostgreSQL
  refuses it), no lone UTF-16 surrogate (no UTF-8 encoding: the page that shows it would fail),
  and bounded in length. Refusals are 400s naming the field; a bad value is never echoed whole.
- Request bodies: JSON, nested at most MAX_JSON_DEPTH levels.
- What a run's config may reach on this server: only the SGLang servers in RLPILOT_SGLANG_URLS,
  engine weights only in the run's own folder, and model / data paths only under
  RLPILOT_MODEL_ROOTS / RLPILOT_DATA_ROOTS (docs/dashboard.md, "Security"). The launch checks
  this (through the actions layer) and the worker checks it again before it trains.

Pure checks: this module reads settings and the config schema, never the database, so every
layer (actions, API, views, tasks, the inspector) may call it.
"""
from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings

from trainer import config as config_mod
from trainer.engine.sglang.urls import parse_urls  # URL parsing only: no requests, no torch

MAX_NAME_LEN = 200          # Run.name is a CharField(200)
MAX_NOTE_LEN = 20_000
MAX_TAGS = 20
MAX_TAG_LEN = 40
MAX_TOML_LEN = 200_000      # a full config as TOML text
MAX_JSON_DEPTH = 32         # nesting of a request body (a config is two levels deep)
MAX_METRIC_KEYS = 200       # ?keys= of /metrics
MAX_ID = 2 ** 63 - 1        # the largest row id (BigAutoField)

# error replies: never echo a long value or key whole, never list thousands of errors
MAX_MESSAGE_LEN = 500
MAX_ERROR_KEY_LEN = 120
MAX_ERRORS = 50


# --- text ------------------------------------------------------------------------------------------

def clip(text: Any, limit: int) -> str:
    """`text` as a str of at most `limit` characters, without NUL or lone surrogates (so it can
    always be encoded, stored and shown)."""
    text = config_mod.UNSTORABLE.sub("\ufffd", str(text))
    return text if len(text) <= limit else text[:max(0, limit - 20)] + f"... ({len(text)} chars)"


def clip_errors(errors: dict | None) -> dict[str, str]:
    """An error dict fit for a reply: keys and messages shortened, at most MAX_ERRORS entries."""
    out: dict[str, str] = {}
    items = list((errors or {}).items())
    for k, v in items[:MAX_ERRORS]:
        out[clip(k, MAX_ERROR_KEY_LEN)] = clip(v, MAX_MESSAGE_LEN)
    if len(items) > MAX_ERRORS:
        out["..."] = f"and {len(items) - MAX_ERRORS} more errors"
    return out


def text_error(value: Any, max_len: int) -> str | None:
    """Why `value` is not acceptable text (None when it is)."""
    if not isinstance(value, str):
        return f"expected text, got {type(value).__name__}"
    return config_mod.text_problem(value, max_len)


def check_name(name: Any) -> str | None:
    if not isinstance(name, str) or not name.strip():
        return "required: a short name for the run"
    return text_error(name.strip(), MAX_NAME_LEN)


def check_note(note: Any) -> str | None:
    problem = text_error(note, MAX_NOTE_LEN)
    return f"{problem} (a note is text of at most {MAX_NOTE_LEN} characters)" if problem else None


def clean_tags(tags: Any) -> tuple[list[str] | None, str | None]:
    """A list of tags (or "a, b") -> (the stripped, deduplicated tags, None) or (None, error)."""
    if isinstance(tags, str):
        tags = tags.split(",")
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        return None, 'expected a list of short strings, or "a, b"'
    clean: list[str] = []
    for i, t in enumerate(tags):
        t = t.strip()
        problem = text_error(t, MAX_TAG_LEN)
        if problem:
            return None, f"tag {i + 1}: {problem} (at most {MAX_TAGS} tags of at most {MAX_TAG_LEN} characters)"
        if t and t not in clean:
            clean.append(t)
    if len(clean) > MAX_TAGS:
        return None, f"{len(clean)} tags: at most {MAX_TAGS} tags of at most {MAX_TAG_LEN} characters"
    return clean, None


# --- request bodies and query parameters ---------------------------------------------------------------

class BadBody(ValueError):
    pass


def parse_json_body(raw: bytes) -> Any:
    """Parse a request body (raises BadBody with a message), at most MAX_JSON_DEPTH levels deep.
    (NaN and Infinity parse, as Python's json reads them; every field that takes a number
    refuses them, naming the key.)"""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise BadBody(f"nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except (ValueError, UnicodeDecodeError) as e:   # incl. integers past Python's digit limit
        raise BadBody(f"not valid JSON ({clip(e, 120)})") from None
    if json_depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise BadBody(f"nested too deeply (at most {MAX_JSON_DEPTH} levels)")
    return value


def json_depth(value: Any, stop_at: int) -> int:
    """Nesting depth of lists/dicts (iterative; stops counting past `stop_at`)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            deepest = max(deepest, d)
            if deepest > stop_at:
                return deepest
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


# --- what a run may reach --------------------------------------------------------------------------

def _norm_url(url: str) -> str:
    """http://Host/ -> http://host:80 (the form compared with the allow-list)."""
    try:
        p = urlsplit(url.strip())
        port = p.port or (443 if p.scheme == "https" else 80)
    except ValueError:   # a port out of range
        return url.strip()
    return f"{p.scheme.lower()}://{(p.hostname or '').lower()}:{port}{p.path.rstrip('/')}"


def _roots(paths) -> list[str]:
    return [os.path.realpath(os.fspath(p)) for p in paths]


def path_problem(value: str, roots: list[str], setting: str) -> str | None:
    """None when `value` resolves (symlinks, `..`) to a path inside one of `roots`. The answer
    is the same whether the path exists or not, so it reveals nothing outside the roots."""
    allowed = ", ".join(roots) if roots else "none"
    where = f"a path under one of the folders in {setting} ({allowed})"
    if not roots:
        return f"no folder is allowed here: {setting} is empty"
    if not os.path.isabs(value):
        return f"expected an absolute path: {where}"
    try:
        real = os.path.realpath(value)
    except (ValueError, OSError):
        return f"not allowed: expected {where}"
    for root in roots:
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return None
    return f"not allowed: expected {where}"


SGLANG_DISABLED = ("the SGLang engine is not enabled on this server (the administrator lists the "
                   "SGLang servers runs may use in RLPILOT_SGLANG_URLS)")


def _sglang_allowed() -> list[str]:
    return [u for u in getattr(settings, "RLPILOT_SGLANG_URLS", []) if u.strip()]


def unavailable_choices(name: str) -> dict[str, str]:
    """The choices of a config key that this server refuses, with why: the launch form shows
    them disabled instead of offering what config_problems() would then refuse."""
    if name == "rollout.engine" and not _sglang_allowed():
        return {"sglang": SGLANG_DISABLED}
    return {}


def machine_train_procs(device: str) -> tuple[int, str]:
    """The training processes this machine holds, and what they are counted by: one per GPU
    when the model runs on CUDA, else one per CPU core (imported here: torch, which only a
    worker needs)."""
    import torch

    from trainer.models.loading import resolve_device

    if resolve_device(device).type == "cuda":
        return torch.cuda.device_count(), "GPU"
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return len(cores), "CPU"   # the cores this process may use (a container's, a taskset's)


def train_procs_problem(cfg: config_mod.Config, on_worker: bool) -> str | None:
    """cluster.train_procs above RLPILOT_MAX_TRAIN_PROCS; when that is 0 (the default), above
    this machine's GPUs or CPU cores, which only the worker that would start them can judge."""
    n = cfg.cluster.train_procs
    limit = settings.RLPILOT_MAX_TRAIN_PROCS
    if limit > 0:
        source = "RLPILOT_MAX_TRAIN_PROCS"
    elif on_worker and n > 1:
        limit, unit = machine_train_procs(cfg.model.device)
        source = f"its {unit} count; RLPILOT_MAX_TRAIN_PROCS sets another limit"
    else:
        return None
    if n > limit:
        return f"at most {limit} training processes on this worker ({source}); got {n}"
    return None


def gen_procs_problem(cfg: config_mod.Config) -> str | None:
    """cluster.gen_procs above RLPILOT_MAX_GEN_PROCS: each generation process holds a copy of
    the model (and one more in shared memory), so a run may not fill the worker's memory."""
    n, limit = cfg.cluster.gen_procs, settings.RLPILOT_MAX_GEN_PROCS
    if n > limit:
        return f"at most {limit} generation processes on this server (RLPILOT_MAX_GEN_PROCS); got {n}"
    return None


def config_problems(cfg: config_mod.Config, on_worker: bool = False) -> dict[str, str]:
    """What a run's config may not do on this server: {dotted key: message}. Checked at launch
    from the web and again by the worker (`on_worker`: with its own settings and machine)
    before it trains."""
    errors: dict[str, str] = {}
    from trainer.sandbox.preflight import launch_problems  # (probes bwrap once per process)
    errors.update(launch_problems(cfg))
    from trainer.episode.interface import launch_problems as environment_problems
    errors.update(environment_problems(cfg))   # episode.environment imports, implements, builds
    problem = train_procs_problem(cfg, on_worker)
    if problem:
        errors["cluster.train_procs"] = problem
    problem = gen_procs_problem(cfg)
    if problem:
        errors["cluster.gen_procs"] = problem
    r = cfg.rollout
    allowed = _sglang_allowed()
    if r.engine == "sglang" or r.sglang_urls.strip():
        if not allowed:
            key = "rollout.engine" if r.engine == "sglang" else "rollout.sglang_urls"
            errors[key] = SGLANG_DISABLED
        else:
            try:
                urls = parse_urls(r.sglang_urls)
            except ValueError:
                urls = []   # check() has said what is wrong with them
            ok = {_norm_url(u) for u in allowed}
            bad = [u for u in urls if _norm_url(u) not in ok]
            if bad:
                errors["rollout.sglang_urls"] = (f"{len(bad)} server(s) not allowed here; allowed "
                                                 f"(RLPILOT_SGLANG_URLS): {', '.join(allowed)}")
    if r.sglang_weights_dir:
        errors["rollout.sglang_weights_dir"] = (
            "must be empty here: a run's engine weights are written to its own folder "
            "(RUN_DIR/engine_weights under RLPILOT_RUNS_DIR)")
    if cfg.model.path != "builtin":
        # (imported here: torch) a shipped model's name ("builtin-tools": trainer/assets) is no path
        from trainer.models.loading import BUILTIN_ASSETS, check_model_dir

        problem = None if cfg.model.path in BUILTIN_ASSETS else path_problem(
            cfg.model.path, _roots(settings.RLPILOT_MODEL_ROOTS), "RLPILOT_MODEL_ROOTS")
        if problem:
            errors["model.path"] = problem + ', or "builtin"'
        else:  # an allowed folder or a shipped model: is it a model a run can load?
            problems = check_model_dir(cfg.model.path, engine=r.engine)
            if problems:
                errors["model.path"] = "; ".join(problems)
    if cfg.greso.warm_start:   # another run's statistics: a run folder of this server only
        problem = path_problem(cfg.greso.warm_start, [str(settings.RUNS_DIR)], "RLPILOT_RUNS_DIR")
        if problem:
            errors["greso.warm_start"] = problem + " (a run's folder)"
    for key in ("data.path", "data.eval_path"):
        value = cfg.get(key)
        if value:
            problem = path_problem(value, _roots(settings.RLPILOT_DATA_ROOTS), "RLPILOT_DATA_ROOTS")
            if not problem:  # inside the roots: may it be read? (checked again when read)
                from trainer.tasks.jsonl import size_problem

                problem = size_problem(value)
            if problem:
                errors[key] = problem
    return errors
