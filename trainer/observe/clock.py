"""Two clocks: when something happened, and how long it took.

    time.time()        the wall clock: when (metrics rows, events, a knob's applied_at). A
                       machine may step it (NTP) by seconds at any moment.
    now()              the timeline's clock: the wall clock read once at an anchor, advanced by
                       the monotonic clock since. Its differences are monotonic durations (a
                       step of the wall clock never lands in a span, a cost, a CPU share or a
                       forecast); its values stay near the wall clock (off by the steps since
                       the anchor), so they still say roughly when.

    now() = anchor_wall + (time.monotonic() - anchor_monotonic)

One anchor per machine and run: the first process to import this module sets it and passes it
on in the environment (RLPILOT_CLOCK_ANCHOR), so its children on the same machine (engine
processes, training ranks) share it and their lanes line up exactly (Linux's CLOCK_MONOTONIC is
one clock for every process of a machine). A process on another machine (or one given an anchor
from elsewhere) anchors itself: there the lanes line up as well as the two wall clocks do.
"""
from __future__ import annotations

import os
import socket
import time

ENV = "RLPILOT_CLOCK_ANCHOR"


def _anchor() -> tuple[float, float]:
    """(wall, monotonic) of this machine's anchor: inherited when set here, else taken now."""
    host = socket.gethostname()
    try:
        name, wall, mono = os.environ[ENV].rsplit(" ", 2)
        if name == host and float(mono) <= time.monotonic():
            return float(wall), float(mono)
    except (KeyError, ValueError):
        pass
    wall, mono = time.time(), time.monotonic()
    os.environ[ENV] = f"{host} {wall!r} {mono!r}"
    return wall, mono


_WALL, _MONO = _anchor()


def now() -> float:
    """Seconds since the epoch on the timeline's clock: differences are monotonic."""
    return _WALL + (time.monotonic() - _MONO)
