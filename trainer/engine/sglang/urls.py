"""SGLang server URLs: the configured list (`rollout.sglang_urls`, parsed by its parameter type,
trainer/config/values.py `parse_urls`) and the address each request goes to. No `requests` or
torch here."""
from __future__ import annotations

from urllib.parse import urlsplit

from trainer.config.values import parse_urls

__all__ = ["parse_urls", "request_base"]


def request_base(url: str) -> str:
    """The scheme://host:port/path a server's requests go to: no user:password@, no ?query."""
    parts = urlsplit(url)
    host = parts.hostname
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if ":" in host:  # IPv6
        host = f"[{host}]"
    return f"{parts.scheme}://{host}:{port}{parts.path.rstrip('/')}"
