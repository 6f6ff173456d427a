"""The timeline (where each process's time went) on the web side: the trainer's spans stored
one row per step, cleaned; sent over the socket's protocol as `timeline` frames; the API's last
steps (live) and the whole run thinned (report); a resume's rewind drops later steps. Then in
headless Chromium: a real run on the Celery worker (preset `async`: the controller waits for
the engine process's groups) drawn live, lane by lane, and its report. Screenshots go to
RLPILOT_TIMELINE_SCREENSHOT_DIR (default: the test's tmp dir)."""
import json
import os
import shutil
from pathlib import Path

import pytest

from webapp.dashboard import actions
from webapp.dashboard.actions import Record
from webapp.dashboard.models import Run, TimelineSlice
from webapp.dashboard.rows import stream

pytestmark = [pytest.mark.django_db(transaction=True)]


def spans_at(step: int, t0: float = 1.7e9) -> list[dict]:
    base = t0 + 10 * step
    return [{"lane": "rank 0", "phase": "generating", "start": base, "end": base + 4},
            {"lane": "rank 0", "phase": "training", "start": base + 4, "end": base + 9},
            {"lane": "rank 1", "phase": "training", "start": base + 4.1, "end": base + 8.5},
            {"lane": "engine", "phase": "generating", "start": base, "end": base + 4, "occupancy": 0.5}]


def test_spans_are_stored_cleaned_and_streamed(make_run, user):
    run = make_run(user)
    bad = [{"lane": "rank 0", "phase": "training", "start": 5, "end": 4},       # ends first
           {"lane": "", "phase": "training", "start": 1, "end": 2},             # no lane
           {"lane": "rank 0", "phase": "training", "start": "x", "end": 2},     # not a number
           {"lane": "engine", "phase": "generating", "start": 1, "end": 2, "occupancy": 7}, "junk"]
    cursor = Run.objects.get(pk=run.pk).last_seq
    actions.append(run.pk, [Record("timeline", 1, "", {"spans": spans_at(1) + bad})])
    row = TimelineSlice.objects.get(run=run)
    assert row.step == 1 and len(row.spans) == 5
    assert row.spans[-1] == {"lane": "engine", "phase": "generating", "start": 1.0, "end": 2.0,
                             "occupancy": 1.0}   # clamped into [0, 1]
    msgs, _ = stream.messages_after(run.pk, cursor)
    assert msgs == [{"type": "timeline", "step": 1, "spans": row.spans, "cursor": row.seq}]


def test_the_api_gives_the_last_steps_or_the_whole_run_thinned(make_run, user, alice):
    run = make_run(user)
    actions.append(run.pk, [Record("timeline", s, "", {"spans": spans_at(s)}) for s in range(1, 31)])
    live = alice.get(f"/api/runs/{run.pk}/timeline?last=5").json()
    assert [s["step"] for s in live["slices"]] == [26, 27, 28, 29, 30] and live["totals"] is None
    report = alice.get(f"/api/runs/{run.pk}/timeline?max_slices=10").json()
    steps = [s["step"] for s in report["slices"]]
    assert len(steps) == 10 and steps[0] == 1 and steps[-1] == 30 and report["stride"] == 3
    # the totals count every step, thinned or not
    assert report["totals"]["rank 0"] == {"generating": pytest.approx(120.0), "training": pytest.approx(150.0)}
    assert report["totals"]["rank 1"]["training"] == pytest.approx(30 * 4.4)
    assert report["extent"] == pytest.approx(30 * 9.0)   # each step's first start to last end
    for query in ("last=0", "last=x", "max_slices=1", "max_slices=99999"):
        r = alice.get(f"/api/runs/{run.pk}/timeline?{query}")
        assert r.status_code == 400, query
        assert set(r.json()["errors"]) == {query.split("=")[0]}
    empty = make_run(user)
    assert alice.get(f"/api/runs/{empty.pk}/timeline").json()["slices"] == []
    assert alice.get("/api/runs/999999/timeline").status_code == 404


def test_a_rewind_drops_the_later_steps(make_run, user):
    run = make_run(user)
    actions.append(run.pk, [Record("timeline", s, "", {"spans": spans_at(s)}) for s in range(1, 6)])
    actions.rewind(run.pk, 3, from_checkpoint=True)
    assert sorted(TimelineSlice.objects.filter(run=run).values_list("step", flat=True)) == [1, 2, 3]


def test_the_database_sink_writes_a_steps_timeline(make_run, user):
    from webapp.dashboard.worker.telemetry import DbSink

    run = make_run(user)

    class Bell:
        def ring(self, run_id, seq):
            pass

        def close(self):
            pass

    sink = DbSink(run.pk, doorbell=Bell())
    sink.timeline(4, spans_at(4))
    sink.timeline(5, [])          # nothing recorded: no row
    sink.close()
    assert list(TimelineSlice.objects.filter(run=run).values_list("step", flat=True)) == [4]


# --- in the browser ------------------------------------------------------------------------------

EVIL = "<b>gen</b> 0"


def test_the_exports_carry_the_timeline(make_run, user, alice):
    run = make_run(user)
    actions.append(run.pk, [Record("timeline", s, "", {"spans": spans_at(s)}) for s in range(1, 4)])
    data = json.loads(alice.get(f"/api/runs/{run.pk}/export?format=json").content)
    assert [t["step"] for t in data["timeline"]] == [1, 2, 3] and len(data["timeline"][0]["spans"]) == 4
    html = alice.get(f"/api/runs/{run.pk}/export?format=html").content.decode()
    assert 'id="timeline-data"' in html and "RLTimeline" in html and "dashboard/timeline.js" not in html


# what Plotly DREW: the lanes (y tick labels, top to bottom on screen), the phases (legend
# entries) and the bars of each phase's trace
DRAWN = """() => { const gd = document.getElementById('timeline-chart');
  const traces = [...gd.querySelectorAll('.barlayer .trace.bars')];
  const ticks = [...gd.querySelectorAll('.yaxislayer-above .ytick text')];
  ticks.sort((a, b) => a.getBoundingClientRect().top - b.getBoundingClientRect().top);
  return {lanes: ticks.map(t => t.textContent),
          legend: [...gd.querySelectorAll('.legend .traces .legendtext')].map(t => t.textContent),
          bars: traces.map(t => t.querySelectorAll('.point path').length),
          steps: +gd.getAttribute('data-steps'), first: +gd.getAttribute('data-first-step'),
          last: +gd.getAttribute('data-last-step')}; }"""
TOTALS = """() => [...document.querySelectorAll('#timeline-totals .barlayer .point path')]
  .filter(p => p.getBBox().width > 0).length"""
DRAWN_COUNT = "() => +document.getElementById('timeline').getAttribute('data-drawn')"
HOVER_TEXT = "id => document.querySelector('#' + id + ' .hoverlayer')?.textContent || ''"
# the screen position of a line chart's last drawn point (first trace), and how many it drew
LAST_POINT = """id => { const gd = document.getElementById(id); gd.scrollIntoView({block: "center"});
  const pts = gd.calcdata[0], p = pts[pts.length - 1], xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
  const r = gd.getBoundingClientRect();
  return {x: r.left + xa._offset + xa.c2p(p.x), y: r.top + ya._offset + ya.c2p(p.y), n: pts.length}; }"""


def _a_step_arrives(page, rid: int, slices: int, timeout_s: float = 120.0) -> None:
    """Until a step past `slices` timeline rows is stored, then 4 s for the socket to bring it
    to the page: the hold is checked against a step that certainly came, not against a fixed
    4 s in which a busy machine's run may finish no step."""
    import time

    deadline = time.monotonic() + timeout_s
    while TimelineSlice.objects.filter(run_id=rid).count() <= slices:
        assert time.monotonic() < deadline, "no step arrived: the hold proves nothing"
        page.wait_for_timeout(200)
    page.wait_for_timeout(4000)


def _hover(page, chart: str, where, tries: int = 3) -> str:
    """The hover label of `chart` with the pointer at where() (x, y), as a person's pointer finds
    it: a redraw between finding the point and reaching it moves the point, so try again."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for _ in range(tries):
        page.mouse.move(*where())
        try:
            page.wait_for_function(f"() => ({HOVER_TEXT})('{chart}').length > 0", timeout=3000)
            break
        except PlaywrightTimeout:   # the pointer met nothing
            page.mouse.move(5, 5)
    return page.evaluate(HOVER_TEXT, chart)


def _last_point(page, chart: str):
    p = page.evaluate(LAST_POINT, chart)
    return p["x"], p["y"]


def _last_bar(page, trace: int):
    box = page.locator("#timeline-chart .barlayer .trace.bars").nth(trace).locator(".point path").last.bounding_box()
    return box["x"] + box["width"] / 2, box["y"] + box["height"] / 2


@pytest.mark.slow
@pytest.mark.embedded_only
def test_the_offline_report_draws_every_lane_in_order(make_run, user, tmp_path, monkeypatch):
    """Four training ranks (rank 10 after rank 2), two generators, one named with markup: the
    offline HTML export, no network."""
    from conftest import browser_page

    from webapp.dashboard.reports import exports

    run = make_run(user, "finished")
    recs = []
    for step in range(1, 5):
        base = 1.7e9 + 10 * step
        spans = [{"lane": "rank 0", "phase": "generating", "start": base, "end": base + 3},
                 {"lane": "rank 0", "phase": "training", "start": base + 3, "end": base + 8}]
        for r in (1, 2, 10):
            spans += [{"lane": f"rank {r}", "phase": "waiting", "start": base, "end": base + 3},
                      {"lane": f"rank {r}", "phase": "training", "start": base + 3, "end": base + 7 + 0.1 * r}]
        spans += [{"lane": "engine", "phase": "generating", "start": base, "end": base + 3, "occupancy": 0.9},
                  {"lane": EVIL, "phase": "generating", "start": base, "end": base + 2, "occupancy": 0.2}]
        recs.append(Record("timeline", step, "", {"spans": spans}))
    actions.append(run.pk, recs)
    path = tmp_path / "report.html"
    path.write_text(exports.export_html(run))
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    blocked = []
    with browser_page(viewport={"width": 1300, "height": 900}) as (page, errors):
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file://")
                   else (blocked.append(route.request.url), route.abort()))
        page.goto(path.as_uri())
        page.wait_for_selector("#timeline[data-loaded] #timeline-chart .barlayer .point path")
        drawn = page.evaluate(DRAWN)
        assert drawn["lanes"] == ["rank 0", "rank 1", "rank 2", "rank 10", EVIL, "engine"], drawn
        assert drawn["legend"] == ["generating", "waiting", "training"], drawn
        # per step: 2 generating bars (engine, the markup lane) + rank 0's, 3 waiting, 4 training
        assert drawn["bars"] == [4 * 3, 4 * 3, 4 * 4], drawn
        # the shares: each lane's phases, plus idle where a lane is busy less than the 8 s each
        # step covers: rank 0 2, rank 1 and rank 2 3 (idle), rank 10 2, the generators 2 each
        assert page.evaluate(TOTALS) == 2 + 3 + 3 + 2 + 2 + 2
        page.locator("#timeline").scroll_into_view_if_needed()
        page.screenshot(path=str(tmp_path / "offline.png"))
        print("screenshot:", tmp_path / "offline.png")
    assert not errors and not blocked, (errors, blocked)


@pytest.mark.slow
@pytest.mark.embedded_only   # the live stream over Redis: test_web_e2e's story
def test_timeline_live_and_in_the_report(live_asgi, django_user_model, monkeypatch, tmp_path, tiny,
                                          wait_until):
    from conftest import CHROMIUM, logged_in_page
    from playwright.sync_api import expect

    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing"
    shots = Path(os.environ.get("RLPILOT_TIMELINE_SCREENSHOT_DIR") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    user = django_user_model.objects.create_user("tess", password="tess-pw-123")
    from django.test import Client

    client = Client()
    client.force_login(user)
    r = client.post("/api/runs", json.dumps({"name": "timeline", "preset": "async",
                                             "overrides": {**tiny, "run.max_steps": 2000}}),
                    content_type="application/json")
    assert r.status_code == 201, r.content
    rid = r.json()["id"]
    wait_until(lambda: TimelineSlice.objects.filter(run_id=rid).count() >= 2, 180, "two steps' timelines")

    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    try:
        with logged_in_page(live_asgi, "tess", "tess-pw-123", viewport={"width": 1400, "height": 1000},
                            echo_errors=True) as (page, errors):
            page.goto(f"{live_asgi}/runs/{rid}/")
            expect(page.locator("#conn")).to_have_text("live")
            page.wait_for_selector("#timeline-chart .barlayer .point path")
            first = page.evaluate(DRAWN)
            assert first["lanes"] == ["rank 0", "engine"], first
            assert {"waiting", "training", "generating"} <= set(first["legend"]), first
            assert sum(first["bars"]) >= 4 and all(n > 0 for n in first["bars"]), first
            assert first["steps"] == min(20, first["last"] - first["first"] + 1), first   # the window
            # new steps arrive over the socket and are drawn; the window moves on
            page.wait_for_function(f"() => +document.getElementById('timeline-chart')"
                                   f".getAttribute('data-last-step') >= {first['last'] + 2}", timeout=120_000)
            later = page.evaluate(DRAWN)
            assert later["steps"] <= 20 and later["first"] >= later["last"] - 19, later
            assert sum(later["bars"]) > 0 and later["lanes"] == ["rank 0", "engine"], later
            # the hover names the lane, the phase and the engine's batch occupancy
            hover = _hover(page, "timeline-chart", lambda: _last_bar(page, later["legend"].index("generating")))
            assert "generating" in hover and ("occupancy" in hover or "rank 0" in hover), hover
            # and stays readable while steps go on arriving: the chart holds still under the pointer
            drawn, slices = page.evaluate(DRAWN_COUNT), TimelineSlice.objects.filter(run_id=rid).count()
            _a_step_arrives(page, rid, slices)
            assert page.evaluate(DRAWN_COUNT) == drawn and page.evaluate(HOVER_TEXT, "timeline-chart") == hover
            page.mouse.move(5, 5)   # the pointer leaves: the steps held back are drawn
            page.wait_for_function(f"() => ({DRAWN_COUNT})() > {drawn}", timeout=10_000)
            # so does a metric chart, which extendTraces would otherwise redraw under the label
            hover = _hover(page, "chart-reward", lambda: _last_point(page, "chart-reward"))
            assert "reward" in hover, hover
            points = page.evaluate(LAST_POINT, "chart-reward")["n"]
            slices = TimelineSlice.objects.filter(run_id=rid).count()
            _a_step_arrives(page, rid, slices)
            assert page.evaluate("() => document.getElementById('chart-reward').calcdata[0].length") == points
            assert page.evaluate(HOVER_TEXT, "chart-reward") == hover
            page.mouse.move(5, 5)
            page.wait_for_function(f"() => document.getElementById('chart-reward').calcdata[0].length > {points}",
                                   timeout=10_000)
            page.locator("#timeline").scroll_into_view_if_needed()
            page.screenshot(path=str(shots / "timeline-live.png"), full_page=False)
            print("screenshot:", shots / "timeline-live.png")
            # CPU and memory per process: a drawn line per lane, named in the legend
            page.wait_for_selector("#chart-proc-cpu .scatterlayer .trace .js-line")
            for chart, key in (("proc-cpu", "cpu_pct"), ("proc-mem", "rss_gb")):
                legend = page.evaluate(f"() => [...document.querySelectorAll('#chart-{chart} .legendtext')]"
                                       ".map(t => t.textContent)")
                lines = page.locator(f"#chart-{chart} .scatterlayer .trace .js-line").count()
                assert sorted(legend) == [f"proc/engine/{key}", f"proc/rank0/{key}"] and lines == 2, (legend, lines)
            page.screenshot(path=str(shots / "timeline-live-full.png"), full_page=True)

            r = client.post(f"/api/runs/{rid}/stop", "{}", content_type="application/json")
            assert r.status_code in (200, 202), r.content
            wait_until(lambda: Run.objects.get(pk=rid).status in ("stopped", "finished", "failed"), 120,
                       "the run to stop")
            assert Run.objects.get(pk=rid).status == "stopped", Run.objects.get(pk=rid).error

            page.goto(f"{live_asgi}/runs/{rid}/report/")
            page.wait_for_selector("#timeline[data-loaded] #timeline-chart .barlayer .point path")
            report = page.evaluate(DRAWN)
            steps = TimelineSlice.objects.filter(run_id=rid).values_list("step", flat=True)
            # every step, or the whole run thinned to the report's 150 (a fast run gets past them)
            assert report["steps"] == min(len(steps), 150) and report["lanes"] == ["rank 0", "engine"], report
            assert "checkpointing" in report["legend"], report   # the stop's checkpoint
            assert page.evaluate(TOTALS) >= 4                     # both lanes' shares drawn
            page.locator("#timeline").scroll_into_view_if_needed()
            page.screenshot(path=str(shots / "timeline-report.png"), full_page=False)
            print("screenshot:", shots / "timeline-report.png")
    finally:   # the run is stopped whatever happened in the browser
        Run.objects.filter(pk=rid, status__in=("running", "paused")).update(desired="stop")
    assert not errors, errors
