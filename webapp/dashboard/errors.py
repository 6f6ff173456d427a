"""The errors a write refuses with, each with the HTTP status the API answers (the pages show
the message and the per-field errors). Their own module so that the actions layer and the
checks it calls (access/policy.py, rows/samples.py) raise them without importing each other."""
from __future__ import annotations


class ActionError(Exception):
    status = 400

    def __init__(self, message: str, errors: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.errors = errors or {}


class Invalid(ActionError):
    status = 400


class Forbidden(ActionError):
    status = 403


class Conflict(ActionError):
    status = 409


class TooManyRuns(Invalid):
    """An Invalid (the launch form shows it) answered 429 by the API."""
    status = 429


class Throttled(ActionError):
    """Too much at once from one user or on one run (knob changes, exports): try again later."""
    status = 429
