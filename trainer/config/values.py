"""The parsers of values with more structure than their type: a string parameter that holds a
list, a schedule or addresses. Each is the parameter's type, declared here with the schema, so
that the config checks them (trainer/config/checks.py) without importing the package that acts on
them, and that package reads the value with the same parser:

    rollout.stop               stop_strings     (trainer/engine/stops.py ends responses at them)
    rollout.sglang_urls        parse_urls       (trainer/engine/sglang/)
    episode.tools              parse_tools      (trainer/episode/: TOOLS are the tools it runs)
    lora.target_modules        parse_target_modules   (trainer/models/lora.py)
    async.staleness_schedule   parse_schedule   (trainer/rollout/staleness_schedule.py applies it)

Each raises ValueError saying what is wrong; the config's check files it under the key.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple
from urllib.parse import urlsplit

from trainer.config.text import text_problem

MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 200


def stop_strings(value: str) -> list[str]:
    """`rollout.stop` as a list: "" -> [], '["</answer>", "\\n\\nUser:"]' -> the strings. Raises
    ValueError saying what is wrong (not JSON, not a list of non-empty strings, too many)."""
    import json

    if not value.strip():
        return []
    example = 'expected a JSON list of strings, e.g. ["</answer>"] (empty = none)'
    try:
        out = json.loads(value)
    except (ValueError, RecursionError):
        raise ValueError(f"not valid JSON: {example}") from None
    if not isinstance(out, list) or not all(isinstance(x, str) for x in out):
        raise ValueError(example)
    if any(not x for x in out):
        raise ValueError("a stop string is empty")
    if len(out) > MAX_STOP_STRINGS:
        raise ValueError(f"{len(out)} stop strings; at most {MAX_STOP_STRINGS}")
    for i, x in enumerate(out):  # the same text rules as every config string, after decoding
        problem = text_problem(x, MAX_STOP_LEN)
        if problem:
            raise ValueError(f"stop string {i + 1}: {problem}")
    return list(dict.fromkeys(out))


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


# the tools an episode may offer (trainer/episode/tools.py runs each)
TOOLS = ("calculator", "python")


def parse_tools(value: str) -> tuple[str, ...]:
    """`episode.tools` ("calculator,python") as names; ValueError naming an unknown one."""
    names = tuple(n.strip() for n in (value or "").split(",") if n.strip())
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise ValueError(f"unknown tool {unknown[0]!r}; the tools are {', '.join(TOOLS)}")
    return tuple(dict.fromkeys(names))


def parse_target_modules(value: str) -> list[str] | str:
    """`lora.target_modules`: "all-linear" (PEFT: every linear layer but the output head) or
    comma-separated module names (q_proj, v_proj, ...)."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise ValueError("lora.target_modules: name at least one module, or 'all-linear'")
    return "all-linear" if names == ["all-linear"] else names


class Point(NamedTuple):
    """A point of `async.staleness_schedule`: from the boundary after `step`, eta is `eta`."""
    step: int
    eta: int


def parse_schedule(text: str, eta_range: tuple[int, int] = (0, 64)) -> tuple[Point, ...]:
    """The points of `async.staleness_schedule` ("STEP:ETA, ..."; "" = none). Raises ValueError
    quoting the part at fault: not STEP:ETA with whole numbers, a step not after the one before,
    an eta outside `eta_range` (async.max_staleness's own)."""
    points: list[Point] = []
    lo, hi = eta_range
    for part in (p.strip() for p in text.split(",")) if text.strip() else ():
        step_text, colon, eta_text = part.partition(":")
        try:
            if not colon:
                raise ValueError
            point = Point(int(step_text.strip()), int(eta_text.strip()))
        except ValueError:
            raise ValueError(f"{part!r}: expected STEP:ETA with whole numbers, e.g. "
                             "'0:0, 50:2, 200:4'") from None
        if point.step < 0:
            raise ValueError(f"{part!r}: the step must be 0 or more")
        if not lo <= point.eta <= hi:
            raise ValueError(f"{part!r}: eta must be in [{lo}, {hi}] (async.max_staleness's range)")
        if points and point.step <= points[-1].step:
            raise ValueError(f"{part!r}: steps must increase; step {points[-1].step} comes before it")
        points.append(point)
    return tuple(points)
