"""The names the actions layer calls `limits.*`, until it imports them from the modules that now
hold them: validation.py (text, config problems) and policy.py (the run quota). Nothing else
imports this module (tests/web/test_import_graph.py); delete it with that change.
"""
from __future__ import annotations

from webapp.dashboard.policy import check_active_runs
from webapp.dashboard.validation import (
    MAX_TOML_LEN,
    check_name,
    check_note,
    clean_tags,
    clip_errors,
    config_problems,
    text_error,
)

__all__ = ["MAX_TOML_LEN", "check_active_runs", "check_name", "check_note", "clean_tags",
           "clip_errors", "config_problems", "text_error"]
