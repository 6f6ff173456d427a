"""The SGLang rollout engine: a client of SGLang servers over HTTP (`client`: the engine's public
interface; `dispatch`: requests sent and replies applied; `replies`: a reply read; `failover`:
servers out of service and back; `transport`: HTTP and retries; `weights`: weight publishing;
`precision`: the servers' dtype) and their launcher (`server`)."""
from __future__ import annotations

__all__ = ["SGLangEngine", "EngineError", "WEIGHTS_MARKER", "parse_urls"]

# imported on first use, so that `urls` (what trainer/config/ checks rollout.sglang_urls with)
# comes without requests or torch
_WHERE = {"SGLangEngine": "client", "EngineError": "client", "WEIGHTS_MARKER": "weights",
          "parse_urls": "urls"}


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
