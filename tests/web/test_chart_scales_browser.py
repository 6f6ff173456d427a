"""What the run page draws, read from Plotly's SVG in headless Chromium, for a run whose rows are
appended directly (an APRIL run mixing policy versions, with episodes):

- "Engine vs trainer" draws the engine's own figures (age-0 tokens: KL and max |Δ log p|), not
  the headline that mixes in the policy's drift; the aged parts are drawn as staleness;
- no two unrelated scales share a pixel row: the KL's peak is not drawn at the band's height, and
  the episodes' max turns (2) and tool-use rate (1.0) are not drawn on one row;
- a knob change applied after step 6 says it acts from step 7;
- the forecast says "up to" rather than "0 s" when its low end is 0, and a run that stops shows no
  "To go" from the moment its status arrives, whatever a late reply says.
Screenshots: /tmp/chart-scales-*.png."""
from __future__ import annotations

import json
import shutil

import pytest

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.embedded_only]

SHOTS = "/tmp/chart-scales-{}.png"

# Per trace Plotly drew on a line chart: its name, the axis it is on, and the pixel y (in the
# figure) of each marker it drew; the horizontal shape lines (the band) with their pixel y; the
# pixel extent [top, bottom] of each y axis.
DRAWN = """id => { const gd = document.getElementById(id);
  if (!gd || !gd._fullLayout) return null;
  const traces = [...gd.querySelectorAll('.scatterlayer .trace')].map(t => {
      const d = t.__data__ && t.__data__[0] && t.__data__[0].trace;
      const ys = [...t.querySelectorAll('.points path')].map(p => (p.getAttribute('transform') || '')
          .match(/translate\\(([-\\d.]+),\\s*([-\\d.]+)\\)/)).filter(Boolean).map(m => +m[2]);
      const axis = d ? d.yaxis : null, ax = gd._fullLayout[axis === 'y2' ? 'yaxis2' : 'yaxis'];
      return {name: d ? d.name : null, axis: axis, ys: ys.map(y => ax._offset + y)}; });
  const hlines = [...gd.querySelectorAll('.shapelayer path')].map(p => p.getAttribute('d') || '')
      .map(d => d.match(/^M([-\\d.]+),([-\\d.]+)L([-\\d.]+),([-\\d.]+)$/))
      .filter(m => m && Math.abs(+m[2] - +m[4]) < 0.01 && Math.abs(+m[1] - +m[3]) > 50).map(m => +m[2]);
  const extent = a => a ? [a._offset, a._offset + a._length] : null;
  return {traces: traces, hlines: hlines, y: extent(gd._fullLayout.yaxis), y2: extent(gd._fullLayout.yaxis2),
          title: gd._fullLayout.title.text}; }"""


def drawn(page, chart):
    return page.evaluate(DRAWN, "chart-" + chart)


def trace(d, name):
    return next((t for t in d["traces"] if t["name"] == name), None)


def rows(first, last):
    from webapp.dashboard.actions import Record

    return [Record("points", s, "", {
        # the headline mixes the policy's drift into the engine's error; age 0 is the engine's own
        "mismatch/kl": 4.8e-4, "mismatch/abs_logp_diff_max": 2.0 + 0.1 * s,
        "mismatch/age0/kl": 2e-5 + 1e-6 * s, "mismatch/age0/abs_logp_diff_max": 0.05,
        "mismatch/age1/kl": 6e-4, "mismatch/age2plus/kl": 9e-4,
        "episode/turns": 1.5, "episode/turns/max": 2.0, "episode/tool_use_rate": 1.0,
        "episode/max_turns_ratio": 0.25, "reward/mean": 0.5}) for s in range(first, last + 1)]


def test_the_charts_draw_honest_scales_and_the_engine_s_own_mismatch(live_asgi, django_user_model,
                                                                     monkeypatch, make_run):
    from conftest import CHROMIUM, logged_in_page, wait_until
    from playwright.sync_api import expect

    from webapp.dashboard import actions
    from webapp.dashboard.actions import Record

    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing"
    owner = django_user_model.objects.create_user("hana", password="hana-pw-123")
    run = make_run(owner, "running", max_steps=30, name="scales")
    run.config["april"]["enabled"] = True
    run.save()
    actions.append(run.pk, rows(1, 6), {"step": 6})

    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")   # Playwright's loop runs in this thread
    forecast = {"steps_left": 23, "pace_s": 5.2, "seconds": 130.0, "low_s": 0.0, "high_s": 660.0,
                "window": 1, "price": None, "target": None}
    reply = {"forecast": forecast}

    def api_run(route):   # the run's API reply, its forecast as after one slow step
        body = json.loads(route.fetch().text())
        body.update(reply)
        route.fulfill(status=200, content_type="application/json", body=json.dumps(body))

    with logged_in_page(live_asgi, "hana", "hana-pw-123", viewport={"width": 1400, "height": 1000},
                        timeout_ms=20_000) as (page, errors):
        page.route(f"**/api/runs/{run.pk}", api_run)
        page.goto(f"{live_asgi}/runs/{run.pk}/")
        expect(page.locator("#conn")).to_have_text("live")
        wait_until(lambda: (drawn(page, "mismatch") or {}).get("hlines"), 20, "the mismatch chart and its band")

        # --- the engine's own figures, and the aged parts as staleness
        d = drawn(page, "mismatch")
        assert [t["name"] for t in d["traces"]] == ["mismatch/age0/kl", "mismatch/age0/abs_logp_diff_max"], d
        assert "the engine's own" in d["title"], d["title"]
        age = drawn(page, "mismatch-age")
        assert [t["name"] for t in age["traces"]] == ["mismatch/age0/kl", "mismatch/age1/kl", "mismatch/age2plus/kl"]
        assert age["title"].startswith("Staleness"), age["title"]
        # --- the KL's peak is not drawn at the band's height: its own panel, apart from the band's
        kl, dmax = trace(d, "mismatch/age0/kl"), trace(d, "mismatch/age0/abs_logp_diff_max")
        assert (kl["axis"], dmax["axis"]) == ("y", "y2") and len(kl["ys"]) == 6, d
        band = d["hlines"][0]
        assert d["y"][1] < d["y2"][0] or d["y2"][1] < d["y"][0], d   # the panels do not overlap
        assert d["y2"][0] <= band <= d["y2"][1], d                     # the band on the |Δ log p| panel
        assert all(abs(y - band) > 10 for y in kl["ys"]), (kl, band)
        assert all(y > band for y in dmax["ys"]), (dmax, band)          # 0.05 drawn under ln 2
        # --- max turns (2) and the tool-use rate (1.0) on rows of their own
        e = drawn(page, "episodes")
        turns, rate = trace(e, "episode/turns/max"), trace(e, "episode/tool_use_rate")
        assert turns["axis"] == "y" and rate["axis"] == "y2", e
        assert e["y"][1] < e["y2"][0] or e["y2"][1] < e["y"][0], e
        assert all(abs(a - b) > 10 for a in turns["ys"] for b in rate["ys"]), (turns, rate)
        for chart in ("mismatch", "mismatch-age", "episodes"):
            page.locator(f"#chart-{chart}").scroll_into_view_if_needed()
            page.locator(f"#chart-{chart}").screenshot(path=SHOTS.format(chart))

        # --- the forecast after one slow step: "up to", never "0 s"
        line = page.locator("#run-forecast")
        expect(line).to_contain_text("To go: 23 steps, about 2.2 min (up to 11.0 min)")
        assert "(0 s" not in line.inner_text()

        # --- a change applied at the boundary after step 6 acts from step 7
        actions.append(run.pk, [Record("event", 6, "knob_applied", {
            "requested_by": "hana", "change_id": "c-1", "changes": {"algo.kl_coef": {"old": 0.0, "new": 0.01}}})])
        expect(page.locator("#kc-c-1")).to_have_text("applied from step 7")

        # --- stopped: no "To go" from the status on, though the API reply still carries one
        actions.set_status(run.pk, "stopped")
        expect(page.locator("#run-status")).to_have_text("stopped")
        expect(line).not_to_contain_text("To go", timeout=1_500)
        page.wait_for_timeout(6_000)   # past the next forecast read: its late "To go" is not shown
        expect(line).not_to_contain_text("To go")
        page.locator(".run-head").screenshot(path=SHOTS.format("head-stopped"))
    assert not errors, errors
