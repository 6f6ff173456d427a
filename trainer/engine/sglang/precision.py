"""The SGLang servers' precision (their `--dtype`) against `rollout.dtype` (a mixin of
`SGLangEngine`).

Each server's dtype comes from `GET /server_info`: SGLang 0.5.23 answers with its server
arguments at the top level, `dtype` among them ("float32", "bfloat16", "float16", or "auto" /
"half" / "float" as given on its command line). "auto" is resolved as SGLang resolves it, from
the `config.json` of the server's `model_path` when this machine can read it (a float32
checkpoint runs in float16 -- bfloat16 for Gemma --, any other in the checkpoint's dtype);
otherwise the server's dtype stays unknown.

- `rollout.dtype` = "auto": the servers' dtype is recorded (`served_dtype`, in the run's
  `run_started` event), whatever it is; servers at different dtypes are a warning.
- an explicit `rollout.dtype`: every server must serve exactly that, else `EngineError` when the
  engine starts, naming the server, its dtype and what to change. A server that rejoins after
  being out of service (perhaps restarted with other arguments) is checked again and stays out
  of service, with a warning, when it no longer matches.

New weights are sent in the servers' dtype when every server names the same one itself (not
resolved from "auto", which another SGLang version may resolve otherwise: a float32 weight cast
to a guessed float16 could overflow): half the bytes for a 16-bit server. Otherwise they go as
the trainer holds them, and SGLang converts them itself (it copies them into its parameters,
over both weight paths).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from trainer.engine.base import EngineError

log = logging.getLogger(__name__)

ALIASES = {"half": "float16", "float": "float32", "fp16": "float16", "bf16": "bfloat16",
           "fp32": "float32"}
KNOWN = ("float32", "bfloat16", "float16")


def resolve_auto(model_path: str | None) -> str | None:
    """The dtype SGLang 0.5.23 picks for `--dtype auto` (sglang/srt/configs/model_config.py
    `_get_and_verify_dtype`), from the model's config.json; None when it cannot be read here."""
    if not model_path:
        return None
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    stored = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    stored = ALIASES.get(stored, stored)
    if stored == "float32":
        return "bfloat16" if str(config.get("model_type", "")).startswith("gemma") else "float16"
    return stored if stored in KNOWN else None


def explicit(info) -> bool:
    """Whether a /server_info reply names its dtype itself (not "auto")."""
    if not isinstance(info, dict):
        return False
    dtype = info.get("dtype")
    if dtype is None and isinstance(info.get("server_args"), dict):
        dtype = info["server_args"].get("dtype")
    return ALIASES.get(str(dtype).lower(), str(dtype).lower()) in KNOWN


def dtype_from_info(info) -> str | None:
    """A server's dtype from its /server_info reply: float32, bfloat16 or float16; None when it
    does not say (or says "auto" for a model this machine cannot read)."""
    if not isinstance(info, dict):
        return None
    dtype = info.get("dtype")
    if dtype is None and isinstance(info.get("server_args"), dict):   # other SGLang versions
        dtype = info["server_args"].get("dtype")
    dtype = ALIASES.get(str(dtype).lower(), str(dtype).lower()) if dtype is not None else None
    if dtype == "auto":
        return resolve_auto(info.get("model_path"))
    return dtype if dtype in KNOWN else None


class Precision:
    """The servers' dtypes (`server_dtypes`: url -> dtype or None) and `rollout.dtype`'s check
    (`want_dtype`: "auto" or the dtype every server must serve)."""

    want_dtype = "auto"

    def _learn_dtypes(self) -> None:
        """Every server's dtype, now; EngineError when one differs from an explicit
        rollout.dtype."""
        self.server_dtypes = {}
        for srv in self.servers:
            problem = self._dtype_problem(srv)
            if problem:
                raise EngineError(problem)
        known = set(self.server_dtypes.values())
        if len(known) > 1:
            self._warn("the SGLang servers serve different dtypes: " + ", ".join(
                f"{url} {dtype or 'unknown'}" for url, dtype in self.server_dtypes.items()))

    def _dtype_problem(self, srv, **call) -> str | None:
        """Ask `srv` its dtype (into server_dtypes); why it cannot serve this run, else None."""
        try:
            info = self._call(srv, "GET", "/server_info", **call)
        except EngineError as e:
            info, error = None, str(e)
        else:
            error = "its /server_info does not name a dtype"
        dtype = self.server_dtypes[srv.url] = dtype_from_info(info)
        self.__dict__.setdefault("named_dtypes", {})[srv.url] = explicit(info)
        want = self.want_dtype
        if want == "auto" or dtype == want:
            return None
        if dtype is None:
            return (f"rollout.dtype={want} but the dtype of SGLang server {srv.url} is unknown "
                    f"({error}); start it with --dtype {want} or set rollout.dtype=auto")
        return (f"rollout.dtype={want} but SGLang server {srv.url} serves {dtype} (its "
                f"--dtype); start it with --dtype {want} or set rollout.dtype=auto")

    def _dtype_still_ok(self, srv) -> bool:
        """A server back in service still serves rollout.dtype (False, with a warning, if not:
        it stays out of service; one warning per server and problem)."""
        problem = self._dtype_problem(srv, retry=False, timeout=5.0)
        warned = self.__dict__.setdefault("_dtype_warned", set())
        if problem and (srv.url, problem) not in warned:
            warned.add((srv.url, problem))
            self._warn(f"SGLang server {srv.url} answers again but stays out of service: {problem}")
        return problem is None

    @property
    def served_dtype(self) -> str:
        """What the run reports as the engine's precision: the servers' dtype ("unknown" when
        they do not say; "a, b" when they differ)."""
        dtypes = sorted({d or "unknown" for d in getattr(self, "server_dtypes", {}).values()})
        return ", ".join(dtypes) or "unknown"

    def _wire_dtype(self):
        """The torch dtype to send weights in: the servers' when all name the same one themselves,
        else None (as the trainer holds them)."""
        import torch

        if not all(getattr(self, "named_dtypes", {}).values()):
            return None
        dtypes = set(getattr(self, "server_dtypes", {}).values())
        return getattr(torch, dtypes.pop()) if len(dtypes) == 1 and None not in dtypes else None
