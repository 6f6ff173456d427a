"""The API's frame: the `api` decorator every endpoint wears (methods, authentication: a session
with CSRF or `Authorization: Token <key>`; the JSON body parsed; an ActionError as a JSON reply),
the error reply, and the run lookup. Errors are JSON with a message per field, shortened
(validation.clip_errors); bad input never gives a 500."""
from __future__ import annotations

import functools
import logging

from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, JsonResponse
from django.middleware.csrf import CsrfViewMiddleware
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from webapp.dashboard import actions
from webapp.dashboard.access import validation
from webapp.dashboard.models import ApiToken, Run

log = logging.getLogger(__name__)


def error(status: int, message: str, errors: dict | None = None) -> JsonResponse:
    """An error reply; the message and every error are shortened (a bad value never comes back
    whole)."""
    return JsonResponse({"message": validation.clip(message, validation.MAX_MESSAGE_LEN),
                         "errors": validation.clip_errors(errors)}, status=status)


def _token_user(request: HttpRequest):
    """The user of an `Authorization: Token <key>` header; AnonymousUser for a bad key; None
    without a Token header (other schemes, e.g. Basic from an auth proxy, are not ours: the
    session decides)."""
    header = request.headers.get("Authorization", "")
    kind, _, key = header.strip().partition(" ")
    if kind.lower() != "token":
        return None
    key = key.strip()
    if not key or len(key) > 40 or not key.isascii() or not key.isalnum():
        return AnonymousUser()   # keys are 40 hex digits: anything else matches none
    tok = ApiToken.objects.select_related("user").filter(key=key).first()
    if tok is None or not tok.user.is_active:
        return AnonymousUser()
    ApiToken.objects.filter(pk=tok.pk).update(last_used_at=timezone.now())
    return tok.user


def api(*methods: str):
    """JSON view: authenticates, checks the method and CSRF (session auth), parses the body,
    and turns ActionError into its JSON response."""

    def deco(view):
        @csrf_exempt
        @functools.wraps(view)
        def wrapped(request: HttpRequest, *args, **kwargs):
            if request.method not in methods:
                return error(405, f"method {request.method} not allowed; use {', '.join(methods)}")
            user = _token_user(request)
            if user is None:  # no token: the browser session, with CSRF on writes
                user = request.user
                if request.method not in ("GET", "HEAD", "OPTIONS") and user.is_authenticated:
                    reason = CsrfViewMiddleware(lambda r: None).process_view(request, None, (), {})
                    if reason is not None:
                        return error(403, "CSRF check failed: send the csrftoken cookie's value "
                                          "in an X-CSRFToken header")
            if not user.is_authenticated:
                return error(401, "authentication required: log in, or send 'Authorization: Token <key>'")
            request.user = user
            body = None
            if request.method in ("POST", "PUT", "PATCH"):
                try:
                    raw = request.body or b"{}"
                except RequestDataTooBig:
                    return error(413, "the request body is too large",
                                 {"body": f"at most {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes"})
                try:
                    body = validation.parse_json_body(raw)
                except validation.BadBody as e:
                    return error(400, "the request body is not valid JSON",
                                 {"body": f"expected a JSON object: {e}"})
                if not isinstance(body, dict):
                    return error(400, "expected a JSON object", {"body": "expected a JSON object"})
            try:
                return view(request, body, *args, **kwargs)
            except actions.ActionError as e:
                return error(e.status, e.message, e.errors)
        return wrapped
    return deco


class NotFound(actions.ActionError):
    status = 404


def not_found(request, *args, **kwargs):
    """Every /api/ path that names no endpoint (or a run id no row can have): a JSON 404."""
    return error(404, "no such API endpoint (see the JSON API table in docs/dashboard.md)", {"path": "not found"})


def get_run_or_404(run_id: int) -> Run:
    run = Run.objects.select_related("owner").filter(pk=run_id).first()
    if run is None:
        raise NotFound(f"no run {run_id}", {"id": "not found"})
    return run
