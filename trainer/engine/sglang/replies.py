"""A /generate reply read: its tokens, log-probabilities, finish reason and the policy version of
each token (the server's, when it names a version this engine published).

`Replies` is a mixin of `SGLangEngine` (trainer/engine/sglang/client.py); a reply without what
the engine needs is an `EngineError` whose text never quotes the server (the reply goes to the log).
"""
from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from trainer.engine.base import EngineError
from trainer.engine.sglang.transport import snippet

if TYPE_CHECKING:
    from trainer.engine.sglang.dispatch import Ticket

log = logging.getLogger(__name__)


class Replies:
    """Reading /generate's replies (uses the engine's `_published` versions)."""

    def _parse(self, t: Ticket, res: dict | None):
        """-> token ids, logprobs, finish type, finish message, weight_version."""
        if res is None:
            return [], [], "abort", "aborted", []
        if not isinstance(res, dict) or "meta_info" not in res:
            if t.user_abort or t.update_abort:
                return [], [], "abort", "aborted", []
            log.warning("SGLang server %s: /generate reply without meta_info: %s",
                        t.server.url, snippet(json.dumps(res).encode()))
            raise EngineError(f"SGLang server {t.server.url}: POST /generate returned no "
                              "meta_info (the reply is in the worker's log)")
        meta = res["meta_info"] or {}
        fr = meta.get("finish_reason")
        ftype = fr.get("type") if isinstance(fr, dict) else (fr or "")
        fmsg = fr.get("message", "") if isinstance(fr, dict) else ""
        entries = meta.get("output_token_logprobs")
        out_ids = res.get("output_ids")
        if entries is None:
            if out_ids:
                raise EngineError(f"SGLang server {t.server.url}: POST /generate returned "
                                  "tokens without meta_info.output_token_logprobs "
                                  "(return_logprob ignored?)")
            entries = []
        lps = [float(e[0]) for e in entries]
        ids = [int(e[1]) for e in entries]
        if out_ids is not None and list(map(int, out_ids)) != ids:
            raise EngineError(f"SGLang server {t.server.url}: POST /generate: output_ids and "
                              f"output_token_logprobs disagree ({len(out_ids)} vs {len(ids)} "
                              "tokens)")
        return ids, lps, ftype, fmsg, self._token_versions(meta, len(ids), t.version)

    def _token_versions(self, meta: dict, n: int, dispatch_version: int) -> list[int]:
        """The policy version of each of the n tokens, as the server reports it:
        `meta_info.weight_versions` spans ([{version, start, end}], SGLang >= 0.5.2x, present
        when the weights changed under a running request), else `meta_info.weight_version` for
        all of them. A version this engine never published (e.g. the server's "default" before
        the first update) reads as the version the call was sent under."""
        out = [self._token_version(meta.get("weight_version"), dispatch_version)] * n
        spans = meta.get("weight_versions")
        if isinstance(spans, list):
            for span in spans:
                if isinstance(span, dict):
                    v = self._token_version(span.get("version"), dispatch_version)
                    start, end = int(span.get("start", 0)), int(span.get("end", n))
                    out[max(start, 0):min(end, n)] = [v] * max(0, min(end, n) - max(start, 0))
        return out

    def _token_version(self, wv, dispatch_version: int) -> int:
        try:
            v = int(str(wv))
        except (TypeError, ValueError):
            return dispatch_version
        return v if v == dispatch_version or v in self._published else dispatch_version


def input_logprobs(res, n: int, url: str) -> list[float]:
    """log p(ids[t] | ids[:t]) for t = 1..n-1 from a /generate reply to `n` input ids sent with
    return_logprob and logprob_start_len 0: `meta_info.input_token_logprobs` ([logprob,
    token_id, text] per input token; the first token's logprob is null, nothing predicts it)."""
    meta = res.get("meta_info") if isinstance(res, dict) else None
    entries = (meta or {}).get("input_token_logprobs")
    if not isinstance(entries, list):
        raise EngineError(f"SGLang server {url}: POST /generate returned no "
                          "meta_info.input_token_logprobs (logprob_start_len ignored?)")
    lps = [e[0] for e in entries if isinstance(e, (list, tuple)) and e]
    while lps and lps[0] is None:
        lps = lps[1:]
    if len(lps) != n - 1 or any(x is None for x in lps):
        raise EngineError(f"SGLang server {url}: POST /generate returned {len(lps)} input "
                          f"log-probabilities for {n} input tokens (expected {n - 1})")
    return [float(x) for x in lps]

