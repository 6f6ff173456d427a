"""SGLang server URLs: parsing the configured list (`rollout.sglang_urls`) and the address each
request goes to. No `requests` or torch here: trainer/config/ checks URLs with `parse_urls`."""
from __future__ import annotations

from typing import Iterable
from urllib.parse import urlsplit

__all__ = ["parse_urls", "request_base"]


def parse_urls(urls: str | Iterable[str]) -> list[str]:
    """'http://a:30000, http://b:30000' -> ['http://a:30000', 'http://b:30000']."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    out = [u.strip().rstrip("/") for u in items if u and u.strip()]
    for u in out:
        parts = urlsplit(u)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) server URL: {u!r} "
                             "(expected e.g. http://127.0.0.1:30000)")
    return out


def request_base(url: str) -> str:
    """The scheme://host:port/path a server's requests go to: no user:password@, no ?query."""
    parts = urlsplit(url)
    host = parts.hostname
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if ":" in host:  # IPv6
        host = f"[{host}]"
    return f"{parts.scheme}://{host}:{port}{parts.path.rstrip('/')}"
