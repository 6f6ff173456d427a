"""async.staleness_schedule on the η chart, in headless Chromium: a run at step 12 of 30 with the
schedule "0:0, 10:2, 20:4" draws its points still ahead as a dashed step line from the latest
step (η 2, the value in force) to 4 at step 20, on to run.max_steps; once the point 20 is passed
(rows to step 22 and the schedule's knob_applied arrive live) the line is gone; a stopped run's
report draws what was still ahead of it. Read from what Plotly drew (the trace's SVG path and
its data), not from our arrays. Screenshots: /tmp/schedule-*.png."""
import shutil

import pytest

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.embedded_only]

SHOTS = "/tmp/schedule-{}.png"
SCHEDULE = "0:0, 10:2, 20:4"

# The traces Plotly drew on a chart: name, whether its line has an SVG path, and its data as
# Plotly holds it (x, y, line shape and dash)
TRACES = """id => { const gd = document.getElementById(id);
  if (!gd || !gd._fullData) return null;
  const drawn = [...gd.querySelectorAll('.scatterlayer .trace')].map(t => {
      const d = t.__data__ && t.__data__[0] && t.__data__[0].trace;
      const line = t.querySelector('.js-line');
      return {name: d ? d.name : null, line: !!(line && (line.getAttribute('d') || '').length > 2)}; });
  return gd._fullData.map((t, i) => ({name: t.name, x: Array.from(t.x), y: Array.from(t.y),
      shape: t.line && t.line.shape, dash: t.line && t.line.dash,
      drawn: drawn.some(d => d.name === t.name && d.line)})); }"""


def rows(first, last, eta_at):
    from webapp.dashboard.actions import Record

    return [Record("points", s, "", {"async/staleness/mean": 0.5, "async/staleness/max": 1.0,
                                     "async/max_staleness": eta_at(s), "reward/mean": 0.5})
            for s in range(first, last + 1)]


def eta_set(step, old, new):
    from webapp.dashboard.actions import Record

    return Record("event", step, "knob_applied", {
        "requested_by": "schedule", "changes": {"async.max_staleness": {"old": old, "new": new}},
        "reason": {"rule": "staleness_schedule", "point": f"{step}:{new}", "schedule": SCHEDULE}})


def schedule_trace(page):
    traces = page.evaluate(TRACES, "chart-staleness") or []
    return next((t for t in traces if t["name"] == "η schedule"), None)


def test_the_eta_chart_draws_the_schedule_ahead(live_asgi, django_user_model, monkeypatch, make_run):
    from conftest import CHROMIUM, logged_in_page, wait_until
    from playwright.sync_api import expect

    from webapp.dashboard import actions
    from webapp.dashboard.models import Run

    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing"
    owner = django_user_model.objects.create_user("sam", password="sam-pw-123")
    run = make_run(owner, "running", max_steps=30, name="scheduled")
    run.config["async"].update(enabled=True, staleness_schedule=SCHEDULE)
    run.knobs.update({"async.staleness_schedule": SCHEDULE, "async.max_staleness": 2})
    run.save()
    actions.append(run.pk, [eta_set(0, 2, 0)] + rows(1, 10, lambda s: 0) + [eta_set(10, 0, 2)]
                   + rows(11, 12, lambda s: 2), {"step": 12})

    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")   # Playwright's loop runs in this thread
    with logged_in_page(live_asgi, "sam", "sam-pw-123", viewport={"width": 1400, "height": 1000},
                        timeout_ms=20_000) as (page, errors):
        page.goto(f"{live_asgi}/runs/{run.pk}/")
        expect(page.locator("#conn")).to_have_text("live")
        wait_until(lambda: schedule_trace(page), 20, "the schedule's line on the η chart")
        t = schedule_trace(page)
        # from step 12 at η 2 (in force), 4 from the point at step 20, on to run.max_steps = 30
        assert (t["x"], t["y"], t["shape"], t["dash"]) == ([12, 20, 30], [2, 4, 4], "hv", "dash"), t
        assert t["drawn"], t
        page.locator("#chart-staleness").scroll_into_view_if_needed()
        page.locator("#chart-staleness").screenshot(path=SHOTS.format("01-live-ahead"))

        # --- live: steps 13-20, then the point 20:4 applied: nothing is ahead any more
        actions.append(run.pk, rows(13, 20, lambda s: 2) + [eta_set(20, 2, 4)] + rows(21, 22, lambda s: 4),
                       {"step": 22})
        wait_until(lambda: schedule_trace(page) is None, 20, "the schedule's line gone past its last point")
        expect(page.locator("#chart-staleness .annotation-text", has_text="η = 4")).to_have_count(1)

        # --- the report of a run stopped at step 12 draws what was still ahead of it
        Run.objects.filter(pk=run.pk).update(status="stopped")
        other = make_run(owner, "stopped", max_steps=30, name="stopped early")
        other.config["async"].update(enabled=True, staleness_schedule=SCHEDULE)
        other.knobs.update({"async.staleness_schedule": SCHEDULE, "async.max_staleness": 2})
        other.save()
        actions.append(other.pk, rows(1, 10, lambda s: 0) + [eta_set(10, 0, 2)] + rows(11, 12, lambda s: 2),
                       {"step": 12})
        page.goto(f"{live_asgi}/runs/{other.pk}/report/")
        page.wait_for_selector("body[data-charts-drawn='1']")
        t = schedule_trace(page)
        assert t and (t["x"], t["y"]) == ([12, 20, 30], [2, 4, 4]) and t["drawn"], t
        page.locator("#chart-staleness").screenshot(path=SHOTS.format("02-report-ahead"))
    assert not errors, errors
