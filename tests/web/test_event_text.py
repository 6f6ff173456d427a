"""The report page writes events the way the live page's event log does (readable text, not
Python dictionaries), escapes what users typed, and shows any alert rule in its banner."""
import pytest

from webapp.dashboard import actions, formatting
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
    ("knob_applied", {"requested_by": "schedule", "changes": {"async.max_staleness": {"old": 0, "new": 2}},
                      "reason": {"rule": "staleness_schedule", "point": "50:2", "schedule": "0:0, 50:2"}},
     "async.max_staleness: 0 → 2 (by the schedule: point 50:2)"),
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
    ("run_resumed", {"max_steps": 9, "devices": {"rank 0": {"kind": "gpu", "count": 1},
                                                 "engine 1": {"kind": "gpu", "count": 1}}},
     "max_steps=9 devices=rank 0 (1 gpu), engine 1 (1 gpu)"),
    ("rewound", {"step": 10, "from_checkpoint": True}, "step=10 from_checkpoint=true"),
    ("status", {"status": "failed", "previous": "running", "message": "boom"}, "failed — boom"),
])
def test_describe_event(kind, data, text):
    assert formatting.describe_event(kind, data) == text


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


# --- the live page shows the server's text: every event message carries it ---------------------------

EVENTS = [   # (kind, data): each rule of describe_event, an autopilot change, a user's text
    ("knob_applied", {"change_id": "c1", "requested_by": "alice",
                      "changes": {"optim.lr": {"old": 0.0002, "new": 0.0001}}}),
    ("knob_applied", {"change_id": "c2", "requested_by": "autopilot",
                      "changes": {"async.max_staleness": {"old": 1, "new": 2}},
                      "reason": {"rule": "staleness", "message": "η is the bottleneck", "evidence_key": "k1"}}),
    ("auto_staleness", {"changes": {"async.max_staleness": {"old": 2, "new": 1}}, "behave_imp_weight": 1.2}),
    ("knob_requested", {"change_id": "c3", "knobs": {"rollout.max_new_tokens": 16384}, "requested_by": "alice"}),
    ("knob_rejected", {"change_id": "c4", "errors": {"optim.lr": "got 5; expected a number in [0.0, 1.0]"}}),
    ("alert", {"rule": "stalled", "seconds": 61.5}),
    ("warning", {"message": EVIL}),
    ("checkpoint", {"path": "/runs/1/checkpoints/step_000010"}),
    ("run_started", {"max_steps": 200, "device": "cpu"}),
]


def _records(first_step):
    return [Record("event", first_step + i, kind, data) for i, (kind, data) in enumerate(EVENTS)]


def test_every_event_message_carries_the_server_s_text(alice, user, make_run):
    """The WebSocket's frames (stream.messages_after), GET /api/runs/<id>/metrics (the page's first
    read) and the exported report's data: each event and status message has `text`, the line
    describe_event writes (the page has no copy of its own)."""
    from webapp.dashboard.rows import stream

    run = make_run(user, "running")
    actions.append(run.pk, _records(1), {"step": len(EVENTS)})
    frames, _ = stream.messages_after(run.pk, 0)
    snapshot = alice.get(f"/api/runs/{run.pk}/metrics").json()["events"]
    for messages in (frames, snapshot):
        events = [m for m in messages if m["type"] in ("event", "status")]
        assert len(events) == len(EVENTS) + 1   # and the status the run was made with
        for m in events:
            kind = "status" if m["type"] == "status" else m["kind"]
            data = {"status": m["status"]} if kind == "status" else m["data"]
            assert m["text"] == formatting.describe_event(kind, data), m
    texts = [m["text"] for m in snapshot]
    assert "async.max_staleness 1 → 2 (staleness: η is the bottleneck)" in texts[2]
    assert "rollout.max_new_tokens = 16384 (by alice)" in texts
    assert texts[0] == "running"
    html = alice.get(f"/api/runs/{run.pk}/export?format=html").content.decode()
    assert '"text": "optim.lr: 0.0002 \\u2192 0.0001 (by alice)"' in html   # the export's chart data
    # no JavaScript copy of the text left
    from django.conf import settings
    for js in (settings.BASE_DIR / "static" / "dashboard").glob("*.js"):
        assert "function describe(" not in js.read_text() and "describeApplied" not in js.read_text(), js


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
@pytest.mark.embedded_only
def test_the_live_page_shows_the_server_s_text(live_asgi, django_user_model, monkeypatch):
    """In headless Chromium: the event log reads, line for line, "step N kind " + the server's
    text, for the events read on load and for those the socket brings afterwards; the alerts
    banner and a knob change's line in the tuning panel too."""
    import shutil

    from conftest import CHROMIUM, logged_in_page, make_run
    from playwright.sync_api import expect

    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing"
    owner = django_user_model.objects.create_user("erin", password="erin-pw-123")
    run = make_run(owner, "running", name="texts")
    actions.append(run.pk, _records(1), {"step": len(EVENTS)})
    expected = [f"step 0 status {formatting.describe_event('status', {'status': 'running'})}"] + [
        f"step {1 + i} {kind} {formatting.describe_event(kind, data)}" for i, (kind, data) in enumerate(EVENTS)]

    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")   # Playwright's loop runs in this thread
    with logged_in_page(live_asgi, "erin", "erin-pw-123", viewport={"width": 1400, "height": 1000},
                        timeout_ms=20_000) as (page, errors):
        page.goto(f"{live_asgi}/runs/{run.pk}/")
        expect(page.locator("#conn")).to_have_text("live")
        log = page.locator("#event-log > li")
        expect(log).to_have_text(list(reversed(expected)))   # the newest first
        assert EVIL in log.all_inner_texts()[len(EVENTS) - 7]   # as text, not markup
        expect(page.locator('#alerts li[data-rule="stalled"]')).to_have_text("stalled (step 6): seconds=61.5")
        expect(page.locator("#kc-c4")).to_have_text(
            "rejected: " + formatting.describe_event("knob_rejected", EVENTS[4][1]))
        # the socket's: the same lines, after the page has loaded
        actions.append(run.pk, _records(20), {"step": 20 + len(EVENTS)})
        more = [f"step {20 + i} {kind} {formatting.describe_event(kind, data)}"
                for i, (kind, data) in enumerate(EVENTS)]
        expect(log).to_have_text(list(reversed(expected + more)))
        page.screenshot(path="/tmp/event-text.png", full_page=True)
    assert not errors, errors
