"""Fail-over and rejoin: a server whose /generate or weight-update call fails every retry is
taken out of service (a warning): its samples go to the others from their last returned token,
and later updates skip it. It is probed (`/health`) with back-off (1 s, 2 s, ... at most 30 s)
and rejoins: at once when no weights were published yet; else it first gets the current weights
-- with the next update while another server is generating, or at once from the host copy of the
last update's weights when none is. With every server out of service generation waits for one to
come back and fails with EngineError only after `down_timeout_s`.

`FailOver` is a mixin of `SGLangEngine` (trainer/engine/sglang/client.py).
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

from trainer.engine.base import EngineError
from trainer.engine.sglang.transport import Server

if TYPE_CHECKING:
    from trainer.engine.sglang.dispatch import Ticket

log = logging.getLogger(__name__)


class FailOver:
    """Which servers take requests, and taking them out of service and back."""

    def _live_servers(self) -> list[Server]:
        """In service (a stale one too: weight updates are what bring it up to date)."""
        return [srv for srv in self.servers if not srv.down]

    def _usable_servers(self) -> list[Server]:
        """In service and holding the current weights: the ones requests go to."""
        return [srv for srv in self.servers if not srv.down and not srv.stale]

    def _fail_over(self, t: Ticket, err: EngineError) -> bool:
        """Take t's server out of service and resend its sample to the others (or, with none
        left, to the first that comes back), from the tokens it had before this call (the
        failed call returned none)."""
        if not self._take_down(t.server, err):
            return False
        self.requeued += 1
        self._queue.appendleft(t.sample)
        return True

    def _take_down(self, srv: Server, err: EngineError) -> bool:
        """Mark srv out of service after it failed every retry (a warning) and schedule its
        first probe. Always True: with no server left, generation waits for one to come back
        (see `_check_down_timeout`)."""
        if srv.down:
            return True
        srv.down, srv.stale = True, False
        srv.retry_at = time.monotonic() + self._rejoin_delay(srv.failures)
        self._last_down_error = str(err)
        left = [x.url for x in self.servers if not x.down]
        if left:
            self._warn(f"{err}; taken out of service, its requests go to {', '.join(left)}; "
                       "it rejoins when it answers again")
        else:
            self._warn(f"{err}; every SGLang server is out of service: generation waits for one "
                       f"to come back (at most {self.down_timeout_s:g} s)")
        return True

    def _probe_down_servers(self) -> None:
        """Ask each server out of service whose back-off has passed whether it is back."""
        now = time.monotonic()
        for srv in self.servers:
            if not srv.down or srv.retry_at > now:
                continue
            try:
                self._call(srv, "GET", "/health", retry=False, timeout=2.0)
                back = self._dtype_still_ok(srv)   # not if restarted at another dtype
            except EngineError:
                back = False
            if not back:
                srv.failures += 1
                srv.retry_at = time.monotonic() + self._rejoin_delay(srv.failures)
                continue
            self._rejoin(srv)

    def _rejoin_delay(self, failures: int) -> float:
        """Back-off between probes: rejoin_backoff_s, twice that, ... at most 30 s. A server
        that answers /health but fails its requests again keeps its count (reset only by a
        request that succeeds), so a flapping server is probed ever less often."""
        return min(self.rejoin_backoff_s * 2 ** min(failures, 16), 30.0)

    def _rejoin(self, srv: Server) -> None:
        """A server back in service, with the current weights before it gets a request."""
        srv.down = False
        if not self._published:
            self._warn(f"SGLang server {srv.url} is back in service")
            return
        srv.stale = True
        if self._usable_servers():   # the next update brings it up to date
            self._warn(f"SGLang server {srv.url} is back; it takes requests after the next "
                       "weight update")
        else:
            self._refresh_stale()

    def _refresh_stale(self) -> None:
        """No server holds the current weights (the others died since): the servers back in
        service get them now, from the host copy of the last update, rather than waiting for an
        update that cannot come while nothing generates."""
        stale = [srv for srv in self.servers if srv.stale and not srv.down]
        if not stale or self._last_tensors is None:
            return
        try:
            self._publish(self._last_tensors, self.version, stale, broadcast=False)
        except EngineError as e:
            for srv in stale:
                srv.down, srv.failures = True, srv.failures + 1
                srv.retry_at = time.monotonic() + self._rejoin_delay(srv.failures)
            self._warn(f"servers back in service did not take the weights: {e}")
            return
        for srv in stale:
            if srv.down:   # failed the load itself (taken out again)
                continue
            with contextlib.suppress(EngineError):
                self._call(srv, "POST", "/flush_cache", retry=False)
            srv.stale = False
            self._warn(f"SGLang server {srv.url} is back in service with weights version {self.version}")

    def _check_down_timeout(self) -> None:
        if self._all_down_since is None:
            self._all_down_since = time.monotonic()
        elif time.monotonic() - self._all_down_since > self.down_timeout_s:
            raise EngineError(f"no SGLang server has answered for more than {self.down_timeout_s:g} s "
                              f"(last: {self._last_down_error})")

    def _warn(self, message: str) -> None:
        log.warning("%s", message)
        self.warnings.append(message)

    def take_warnings(self) -> list[str]:
        """The non-fatal problems since the last call (a server taken out of service, a refused
        /flush_cache): the runner records each as a warning event."""
        with self.lock:
            out, self.warnings = self.warnings, []
            return out

