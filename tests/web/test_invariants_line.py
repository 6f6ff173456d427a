"""The run page, the report and the HTML export say whether the run's invariants held: "all held"
while every invariants/* figure is 0, in red with the rule, the step and the count once a step
broke one; nothing for a run that reported none (checks off)."""
from __future__ import annotations

import re

import pytest
from helpers import NoBell

from webapp.dashboard.actions import Record
from webapp.dashboard.worker.telemetry import DbSink

pytestmark = pytest.mark.django_db
ZERO = {"invariants/beyond_eta": 0, "invariants/beyond_span": 0, "invariants/trained_twice": 0,
        "invariants/env_loss": 0, "invariants/bound": 0}


def write(run, steps, events=()):
    """Rows as the trainer's database sink writes them."""
    sink = DbSink(run.pk, doorbell=NoBell())
    for step, values in steps:
        sink.scalars(step, values)
    for step, kind, data in events:
        sink.buffer.append(Record("event", step, kind, data))
    with sink.lock:
        records, sink.buffer = sink.buffer, []
    sink._write(records)


def line(client, url) -> str | None:
    """The invariants line as a person reads it (tags dropped), or None when absent."""
    html = client.get(url).content.decode()
    m = re.search(r'<p id="invariants" class="([a-z]+)"[^>]*>(.*?)</p>', html, re.S)
    return None if m is None else f"{m.group(1)}: " + re.sub(r"<[^>]+>", "", m.group(2))


def pages(run):
    return (f"/runs/{run.pk}/", f"/runs/{run.pk}/report/", f"/api/runs/{run.pk}/export?format=html")


def test_a_healthy_run_says_all_held(alice, user, make_run):
    run = make_run(user, "finished")
    write(run, [(1, ZERO), (2, ZERO)])
    for url in pages(run):
        assert line(alice, url) == "muted: Invariants: all held", url


def test_a_broken_invariant_turns_red_with_the_rule_step_and_count(alice, user, make_run):
    run = make_run(user, "finished")
    write(run, [(1, ZERO), (2, {**ZERO, "invariants/beyond_span": 3}), (3, {**ZERO, "invariants/beyond_span": 2})],
          [(2, "invariant_violated", {"rule": "beyond_span", "step": 2, "count": 3, "samples": ["4/0"]}),
           (3, "invariant_violated", {"rule": "beyond_span", "step": 3, "count": 2, "samples": ["5/1"]}),
           (3, "invariant_violated", {"rule": "trained_twice", "step": 3, "count": 1, "samples": ["1/0"]})])
    for url in pages(run):
        assert line(alice, url) == ("error: Invariants: beyond_span broken at step 2 (5 samples over "
                                    "2 steps); trained_twice broken at step 3 (1 sample)"), url


def test_a_run_without_checks_makes_no_claim(alice, user, make_run):
    run = make_run(user, "finished")
    write(run, [(1, {"reward/mean": 0.5})])
    for url in pages(run):
        assert line(alice, url) is None, url
