"""The training–inference mismatch on the live page, in headless Chromium, on the session's real
Celery worker: a tiny demo run launched from the form with `rollout.dtype = bfloat16` (a bf16
engine against the fp32 trainer: a real, small mismatch on CPU). The launch form shows the
[mismatch] section and rollout.dtype as choices; the "Engine vs trainer" chart draws its points
live (counted in the SVG Plotly rendered, not in the data arrays) with the band drawn as a dashed
line on the |Δ log p| axis at ln 2 (mismatch.lower 0.5 and upper 2 meet there); the tuning panel
lists the mismatch knobs; mismatch.upper = 4 and mismatch.correction = truncate applied mid-run
redraw the band as two lines (ln 4 and ln 2) and bring the correction's figures; the chart goes
on growing; no mismatch_high alert for this healthy mismatch. The report page, the offline HTML
export and the comparison draw the band too. Screenshots: /tmp/mismatch-*.png."""
from __future__ import annotations

import math
import re
import shutil

import pytest

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.timeout(420),
              pytest.mark.embedded_only]

SHOTS = "/tmp/mismatch-{}.png"

# What Plotly drew for a line chart: per trace (the d3 datum of each `g.trace` names it) the
# marker paths and whether the line has a path; the horizontal shape lines (the band: y0 = y1)
# with their pixel y; the annotations' texts; and the pixel y of given values on the y2 axis.
DRAWN = """([id, values]) => { const gd = document.getElementById(id);
  if (!gd || !gd._fullLayout) return null;
  const traces = [...gd.querySelectorAll('.scatterlayer .trace')].map(t => {
      const d = t.__data__ && t.__data__[0] && t.__data__[0].trace;
      const line = t.querySelector('.js-line');
      return {name: d ? d.name : null, points: t.querySelectorAll('.points path').length,
              line: !!(line && (line.getAttribute('d') || '').length > 2)}; });
  const hlines = [...gd.querySelectorAll('.shapelayer path')].map(p => p.getAttribute('d') || '')
      .map(d => d.match(/^M([-\\d.]+),([-\\d.]+)L([-\\d.]+),([-\\d.]+)$/))
      .filter(m => m && Math.abs(+m[2] - +m[4]) < 0.01 && Math.abs(+m[1] - +m[3]) > 50)
      .map(m => +m[2]).sort((a, b) => a - b);
  const y2 = gd._fullLayout.yaxis2;
  const annotations = [...gd.querySelectorAll('.annotation-text')].map(a => a.textContent);
  return {traces: traces, hlines: hlines, annotations: annotations,
          at: y2 ? values.map(v => y2._offset + y2.l2p(v)) : null}; }"""


def drawn(page, chart, values=()):
    return page.evaluate(DRAWN, ["chart-" + chart, list(values)])


def points(d, name):
    return sum(t["points"] for t in d["traces"] if t["name"] == name)


def close_to(got, want, tol=1.5):
    return len(got) == len(want) and all(abs(g - w) <= tol for g, w in zip(sorted(got), sorted(want)))


def test_the_mismatch_chart_draws_live_with_its_band(live_asgi, django_user_model, monkeypatch, tiny, wait_until):
    from conftest import CHROMIUM, logged_in_page, submit_launch_form
    from playwright.sync_api import expect

    from webapp.dashboard.models import MetricPoint, Run

    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing (apt-get install -y chromium)"
    django_user_model.objects.create_user("mona", password="mona-pw-123")
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")   # Playwright's loop runs in this thread
    with logged_in_page(live_asgi, "mona", "mona-pw-123", viewport={"width": 1400, "height": 1000},
                        timeout_ms=30_000, dialogs="accept") as (page, errors):
        # --- the launch form: the [mismatch] section, rollout.dtype as a choice
        page.evaluate("document.querySelectorAll('details.section').forEach(d => d.open = true)")
        options = page.evaluate("""() => Object.fromEntries(['rollout.dtype', 'mismatch.correction',
            'mismatch.level', 'mismatch.measure'].map(k => [k, [...document.getElementById('f-' + k).options]
            .map(o => o.value).filter(Boolean)]))""")
        assert options == {"rollout.dtype": ["auto", "float32", "bfloat16", "float16"],
                           "mismatch.correction": ["off", "truncate", "mask", "band"],
                           "mismatch.level": ["token", "sequence", "geometric"],
                           "mismatch.measure": ["true", "false"]}, options
        section = page.locator("details.section:has(#f-mismatch\\.upper)")
        expect(section.locator("summary")).to_have_text("[mismatch]")
        expect(section.locator(".section-note")).to_contain_text("Engine vs trainer")
        expect(section.locator("label[for='f-mismatch.upper'] .knob-tag")).to_have_text("knob")
        page.locator("details.section:has(#f-mismatch\\.upper)").screenshot(path=SHOTS.format("01-form-section"))
        page.fill("#id_name", "bf16 engine")
        page.select_option("#f-rollout\\.dtype", "bfloat16")
        rid = submit_launch_form(page, {**{k: str(v) for k, v in tiny.items()}, "run.max_steps": "500"})
        assert Run.objects.get(pk=rid).config["rollout"]["dtype"] == "bfloat16"
        expect(page.locator("#run-status")).to_have_text("running", timeout=120_000)

        # --- the tuning panel lists the mismatch knobs, in a group of their own
        group = page.locator('#knob-rows details[data-group="mismatch"]')
        expect(group.locator("summary .group-title")).to_contain_text("Training–inference mismatch")
        assert group.locator("tr[data-knob]").evaluate_all("rows => rows.map(r => r.dataset.knob)") == [
            "mismatch.measure", "mismatch.correction", "mismatch.level", "mismatch.lower", "mismatch.upper"]
        expect(page.locator('[data-current="mismatch.upper"]')).to_have_text("2")
        expect(page.locator('[data-current="mismatch.correction"]')).to_have_text("off")

        # --- the chart draws its points live, the band at ln 2 on the |Δ log p| axis
        kl, dmax = "mismatch/kl", "mismatch/abs_logp_diff_max"
        counts: list[tuple[int, int]] = []

        def grown():
            d = drawn(page, "mismatch")
            if d:
                n = (points(d, kl), points(d, dmax))
                if not counts or counts[-1] != n:
                    counts.append(n)
            return len(counts) >= 3 and min(counts[-1]) >= 3
        wait_until(grown, 240, "the Engine vs trainer chart to draw 3 points per trace")
        assert counts == sorted(counts) and all(a == b for a, b in counts), counts   # one point per step each
        d = drawn(page, "mismatch", [math.log(2)])
        assert all(t["line"] for t in d["traces"]), d
        assert close_to(d["hlines"], d["at"]), d                     # one dashed line, at ln 2 on y2
        assert "band: 0.5 ≤ ρ ≤ 2" in d["annotations"], d
        # real figures: a bf16 engine is off the fp32 trainer, by little
        values = list(MetricPoint.objects.filter(run_id=rid, key=dmax).values_list("value", flat=True))
        assert values and max(values) > 1e-3, values
        kls = list(MetricPoint.objects.filter(run_id=rid, key=kl).values_list("value", flat=True))
        assert kls and max(kls) < 1e-2, kls
        expect(page.locator("#chart-mismatch-hist .barlayer .point path").first).to_be_attached()
        page.locator("#chart-mismatch").scroll_into_view_if_needed()
        page.locator("#chart-mismatch").screenshot(path=SHOTS.format("02-chart-band"))

        # --- mismatch.upper and the correction changed mid-run: the band redrawn as two lines
        page.evaluate("document.querySelector('#knob-rows details[data-group=\"mismatch\"]').open = true")
        page.fill('#knob-rows input[name="mismatch.upper"]', "4")
        page.select_option('#knob-rows select[name="mismatch.correction"]', "truncate")
        page.click("#knob-apply")
        expect(page.locator("#knob-changes li").first).to_have_text(re.compile(r"applied from step \d+"),
                                                                    timeout=120_000)
        expect(page.locator('[data-current="mismatch.upper"]')).to_have_text("4")
        expect(page.locator('[data-current="mismatch.correction"]')).to_have_text("truncate")
        wait_until(lambda: len((drawn(page, "mismatch") or {}).get("hlines", [])) == 2, 30, "two band lines")
        d = drawn(page, "mismatch", [math.log(4), math.log(2)])
        assert close_to(d["hlines"], d["at"]), d
        assert {"band: ρ ≤ 4", "band: ρ ≥ 0.5"} <= set(d["annotations"]), d
        # ... the chart goes on growing after that whole redraw, and the correction shows
        n = points(d, kl)
        wait_until(lambda: points(drawn(page, "mismatch"), kl) >= n + 2, 240, "two more points after the change")
        wait_until(lambda: points(drawn(page, "mismatch-correction") or {"traces": []}, "mismatch/correction_weight"),
                   120, "the correction weight drawn")
        expect(page.locator('#alerts li[data-rule="mismatch_high"]')).to_have_count(0)
        page.locator("#chart-mismatch").screenshot(path=SHOTS.format("03-band-after-change"))
        page.screenshot(path=SHOTS.format("04-page"), full_page=True)

        page.click("#btn-kill")
        expect(page.locator("#run-status")).to_have_text("stopped", timeout=60_000)

        # --- the report page and the offline HTML export draw the same band (the run's knobs now)
        two = [math.log(4), math.log(2)]
        page.goto(f"{live_asgi}/runs/{rid}/report/")
        page.wait_for_selector("body[data-charts-drawn='1']")
        wait_until(lambda: len((drawn(page, "mismatch") or {}).get("hlines", [])) == 2, 30, "the report's band")
        d = drawn(page, "mismatch", two)
        assert close_to(d["hlines"], d["at"]) and points(d, kl) >= 3, d
        export = page.request.get(f"{live_asgi}/api/runs/{rid}/export?format=html")
        assert export.ok
        page.set_content(export.text())
        page.wait_for_selector("body[data-charts-drawn='1']")
        d = drawn(page, "mismatch", two)
        assert close_to(d["hlines"], d["at"]) and {"band: ρ ≤ 4", "band: ρ ≥ 0.5"} <= set(d["annotations"]), d

        # --- the comparison: on the |Δ log p| chart, each run's band, naming the runs of an end
        # not every run has (another run, with the default band, and no metrics)
        other = Run.objects.create(owner=Run.objects.get(pk=rid).owner, name="default band", preset="demo",
                                   config=Run.objects.get(pk=rid).config, status="finished",
                                   knobs={**Run.objects.get(pk=rid).knobs, "mismatch.upper": 2.0})
        page.goto(f"{live_asgi}/compare/?ids={rid},{other.pk}")
        page.wait_for_selector("body[data-charts-drawn='1']")
        page.check(f'#metric-picks input[value="{dmax}"]')
        chart = f'#compare-charts div[data-metric="{dmax}"]'
        page.wait_for_selector(chart + " .shapelayer path", state="attached")   # a line: no height
        texts = page.locator(chart + " .annotation-text").evaluate_all("ts => ts.map(t => t.textContent)")
        assert sorted(texts) == sorted([f"band: ρ ≤ 4 (#{rid})",
                                        f"band: ρ ≥ 0.5 (#{rid}); band: 0.5 ≤ ρ ≤ 2 (#{other.pk})"]), texts
        page.locator(chart).screenshot(path=SHOTS.format("05-compare"))
    assert not errors, errors


@pytest.fixture(autouse=True)
def _no_run_left_behind(django_user_model):
    """A failure above leaves its run running on the session's worker: killed here."""
    yield
    from conftest import kill_active_runs

    kill_active_runs("mona")
