"""Login throttling: failed password logins counted per username + client address in the cache,
so guessing one user's password from one address is slow and nobody else is locked out.

After RLPILOT_LOGIN_MAX_FAILURES failures within RLPILOT_LOGIN_WINDOW_S seconds, the
authentication backend (settings.AUTHENTICATION_BACKENDS: every password login, the login page
and /admin/) refuses without checking the password, and the login page answers 429 saying how
long to wait. A cache that is down lets logins through rather than locking everybody out.
"""
from __future__ import annotations

import hashlib
import logging
import math
import time
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.contrib.auth.backends import ModelBackend
from django.contrib.auth.views import LoginView
from django.core.cache import cache
from django.core.exceptions import PermissionDenied

log = logging.getLogger(__name__)


def _now() -> float:
    return time.time()


def client_address(request) -> str:
    """The client's address: REMOTE_ADDR, or behind RLPILOT_TRUSTED_PROXIES = n proxies the n-th
    X-Forwarded-For entry from the right (each trusted proxy appends its peer; entries further
    left were written by the client and prove nothing). A header with fewer entries than that
    did not come through every proxy, so it is ignored, as werkzeug's ProxyFix does."""
    meta = getattr(request, "META", {}) or {}
    n = settings.RLPILOT_TRUSTED_PROXIES
    if n > 0:
        hops = [h.strip() for h in str(meta.get("HTTP_X_FORWARDED_FOR", "")).split(",") if h.strip()]
        if len(hops) >= n:
            return hops[-n]
    return meta.get("REMOTE_ADDR") or "-"


def _throttle_key(request, username: Any) -> str:
    who = f"{str(username or '').strip().casefold()}\n{client_address(request)}"
    digest = hashlib.sha256(who.encode("utf-8", "replace")).hexdigest()[:32]
    return f"rlpilot:login-failures:{digest}"


def login_wait_s(request, username: Any) -> int:
    """Seconds this username must wait before logging in again from this address (0 = may try)."""
    limit = settings.RLPILOT_LOGIN_MAX_FAILURES
    if limit <= 0:
        return 0
    try:
        state = cache.get(_throttle_key(request, username))
    except Exception:   # the cache is down: do not lock everybody out
        log.warning("login throttle: cache unavailable", exc_info=True)
        return 0
    now = _now()
    if isinstance(state, dict) and state.get("n", 0) >= limit and state.get("until", 0) > now:
        return max(1, math.ceil(state["until"] - now))
    return 0


def login_failed(request, username: Any) -> None:
    """Count one failed login (the window starts with the first failure)."""
    if settings.RLPILOT_LOGIN_MAX_FAILURES <= 0:
        return
    key, now = _throttle_key(request, username), _now()
    try:
        state = cache.get(key)
        if not isinstance(state, dict) or state.get("until", 0) <= now:
            state = {"n": 0, "until": now + settings.RLPILOT_LOGIN_WINDOW_S}
        state["n"] += 1
        cache.set(key, state, timeout=max(1, math.ceil(state["until"] - now)))
    except Exception:
        log.warning("login throttle: cache unavailable", exc_info=True)


def login_succeeded(request, username: Any) -> None:
    try:
        cache.delete(_throttle_key(request, username))
    except Exception:
        log.warning("login throttle: cache unavailable", exc_info=True)


class ThrottledModelBackend(ModelBackend):
    """Django's ModelBackend, refusing (without checking the password) a username that failed
    RLPILOT_LOGIN_MAX_FAILURES times from this address in the last RLPILOT_LOGIN_WINDOW_S
    seconds. It guards every password login (the login page and /admin/)."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if username is None:
            username = kwargs.get(get_user_model().USERNAME_FIELD)
        if username is None or password is None:
            return None
        if login_wait_s(request, username):
            raise PermissionDenied("too many failed logins")
        user = super().authenticate(request, username=username, password=password, **kwargs)
        if user is None:
            login_failed(request, username)
        else:
            login_succeeded(request, username)
        return user


class ThrottledLoginView(LoginView):
    """The login page; after too many failures it answers 429 and says how long to wait."""

    def post(self, request, *args, **kwargs):
        wait = login_wait_s(request, request.POST.get("username", ""))
        if wait:
            return self._throttled(wait)
        return super().post(request, *args, **kwargs)

    def form_invalid(self, form):
        wait = login_wait_s(self.request, self.request.POST.get("username", ""))
        if wait:
            return self._throttled(wait)
        return super().form_invalid(form)

    def _throttled(self, wait: int):
        minutes = f" ({math.ceil(wait / 60)} min)" if wait >= 120 else ""
        messages.error(self.request, f"Too many failed logins for this username from your "
                                     f"address: wait {wait} s{minutes}, then try again.")
        form = self.get_form_class()(request=self.request)   # unbound: no "didn't match" text
        return self.render_to_response(self.get_context_data(form=form), status=429)
