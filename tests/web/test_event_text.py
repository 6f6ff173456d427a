"""The report page writes events the way the live page's event log does (readable text, not
Python dictionaries), escapes what users typed, and shows any alert rule in its banner."""
import pytest

from webapp.dashboard import actions, reports
from webapp.dashboard.actions import Record

pytestmark = pytest.mark.django_db

EVIL = '<script>alert("x")</script>'


@pytest.mark.parametrize("kind,data,text", [
    ("knob_applied", {"change_id": "c1", "requested_by": "alice",
                      "changes": {"optim.lr": {"old": 0.0002, "new": 0.0001}}},
     "optim.lr: 0.0002 → 0.0001 (by alice)"),
    ("knob_applied", {"changes": {"optim.lr": {"old": 1e-5, "new": 3e-5},
                                  "rollout.temperature": {"old": 1, "new": 0.7}}},
     "optim.lr: 0.00001 → 0.00003, rollout.temperature: 1 → 0.7"),
    ("auto_staleness", {"changes": {"async.max_staleness": {"old": 2, "new": 1}}, "behave_imp_weight": 1.2},
     "async.max_staleness: 2 → 1 (auto)"),
    ("knob_requested", {"knobs": {"april.enabled": True}, "requested_by": "bob"}, "april.enabled = true (by bob)"),
    ("knob_rejected", {"errors": {"optim.lr": "got 5; expected a number in [0.0, 1.0]"}},
     "optim.lr: got 5; expected a number in [0.0, 1.0]"),
    ("alert", {"rule": "staleness", "message": "staleness 3 is above the bound 2", "value": 3},
     "staleness: staleness 3 is above the bound 2"),
    ("alert", {"rule": "stalled", "seconds": 61.5}, "stalled: seconds=61.5"),
    ("alert_cleared", {"rule": "stalled"}, "stalled cleared"),
    ("warning", {"message": "non-finite loss"}, "non-finite loss"),
    ("checkpoint", {"path": "/runs/1/checkpoints/step_000010"}, "/runs/1/checkpoints/step_000010"),
    ("run_started", {"max_steps": 200, "device": "cpu"}, "max_steps=200 device=cpu"),
    ("rewound", {"step": 10, "from_checkpoint": True}, "step=10 from_checkpoint=true"),
    ("status", {"status": "failed", "previous": "running", "message": "boom"}, "failed — boom"),
])
def test_describe_event(kind, data, text):
    assert reports.describe_event(kind, data) == text


def test_report_events_are_readable_and_escaped(alice, user, make_run):
    run = make_run(user, "running", name=EVIL)
    actions.append(run.pk, [
        Record("event", 3, "knob_applied", {"change_id": "c1", "requested_by": "alice",
                                            "changes": {"optim.lr": {"old": 0.0002, "new": 0.0001}}}),
        Record("event", 4, "warning", {"message": EVIL}),
        Record("event", 5, "alert", {"rule": "stalled", "message": "no step for 120 s"}),
    ], {"step": 5, "alerts": {"active": {"stalled": {"message": "no step for 120 s", "step": 5}}, "state": {}}})
    for url in (f"/runs/{run.pk}/report/", f"/api/runs/{run.pk}/export?format=html"):
        html = alice.get(url).content.decode()
        events = html[html.index('id="report-events"'):]
        events = events[:events.index("</ul>")]
        assert "optim.lr: 0.0002 → 0.0001 (by alice)" in events
        assert "{&#x27;" not in events and "{'" not in events and "&#x27;changes&#x27;" not in events
        assert EVIL not in html and "&lt;script&gt;" in events
        assert "stalled: no step for 120 s" in events
    # the banner, on both pages, for a rule the templates know nothing about
    for url in (f"/runs/{run.pk}/", f"/runs/{run.pk}/report/"):
        html = alice.get(url).content.decode()
        assert '<li data-rule="stalled">stalled (step 5): no step for 120 s</li>' in html
    # the live page has the (hidden) stream notice the socket fills in
    html = alice.get(f"/runs/{run.pk}/").content.decode()
    assert 'id="stream-notice"' in html
