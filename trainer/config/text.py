"""Text that a config string may hold: what the dashboard, the database (PostgreSQL text and JSON)
and TOML can all store. Also used by the webapp for the text it takes from users."""
from __future__ import annotations

import re

# NUL (PostgreSQL refuses it) and lone UTF-16 surrogates (no UTF-8 encoding)
UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
MAX_TEXT_LEN = 100_000  # characters of one config string (a prompt template, a system prompt)


def short_repr(value, limit: int = 80) -> str:
    """repr() cut to `limit` characters: error messages name a bad value, never echo it whole."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit - 12] + f"... ({len(r)} chars)"


def text_problem(value: str, max_len: int) -> str | None:
    """Why `value` cannot be stored (UTF-8, PostgreSQL text/JSON, TOML), or None. Lone UTF-16
    surrogates have no UTF-8 encoding; NUL is refused by PostgreSQL."""
    if len(value) > max_len:
        return f"too long: {len(value)} characters (at most {max_len})"
    bad = UNSTORABLE.search(value)
    if bad:
        ch = bad.group()
        what = "a NUL character" if ch == "\x00" else f"a lone UTF-16 surrogate (U+{ord(ch):04X})"
        return f"contains {what} at character {bad.start()}"
    return None
