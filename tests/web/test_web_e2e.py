"""End to end in headless Chromium (Debian's chromium driven by Playwright): log in, launch a
tiny run with every technique on (preset `all`) from the form, watch what Plotly has DRAWN grow
step by step over the WebSocket (every line trace, the CPU/RAM chart included), check the
tuning panel's order, change knobs and see them applied (and η move on the staleness chart),
the stream notice and a generic alert banner, stop the run, then the report and the
comparison. Screenshots go to the test's tmp dir (their paths are printed); set
RLPILOT_E2E_SCREENSHOT_DIR to keep them somewhere else."""
import math
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from conftest import CHROMIUM

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

# the tiny overrides of conftest.TINY, for the form, plus what preset `all` needs with them.
# The preset's own async.worker (process) runs: its engine child starts inside the daemonic
# Celery prefork child.
FORM = {"rollout.rollout_batch_size": "4", "rollout.n_samples_per_prompt": "4",
        "rollout.max_response_len": "64", "rollout.max_slots": "16", "run.eval_every": "0",
        "run.checkpoint_every": "0", "run.reward_workers": "0", "model.threads": "1",
        "april.segment_max_tokens": "32", "run.max_steps": "3000"}
FORM_SELECTS: dict[str, str] = {}

# what each line chart (an SVG scatter) has drawn: gd.calcdata[i].length per trace, and the
# step of its last drawn point
DRAWN = """() => Object.fromEntries([...document.querySelectorAll('#charts .js-plotly-plot')]
  .filter(gd => (gd.data || []).length && gd.data.every(t => t.type === 'scatter'))
  .map(gd => [gd.id, (gd.data || []).map((t, i) => {
      const cd = (gd.calcdata || [])[i] || [];
      return {name: t.name, n: cd.length, last: cd.length ? cd[cd.length - 1].x : null,
              finite: cd.filter(p => typeof p.y === 'number' && isFinite(p.y)).length};
  })]))"""
# traces of a step's tokens of one policy-version age (mismatch/age0/kl, ...): a step without
# tokens of that age has no point, so they grow, but not every step, and may end before the last
SPORADIC = re.compile(r"^mismatch/age")
# every line trace's last drawn point (but the sporadic ones') is at most one step behind the
# step the page shows
CAUGHT_UP = """() => { const step = Number(document.querySelector('#run-step').textContent);
  return [...document.querySelectorAll('#charts .js-plotly-plot')]
    .filter(gd => (gd.data || []).length && gd.data.every(t => t.type === 'scatter'))
    .every(gd => gd.data.every((t, i) => { const cd = (gd.calcdata || [])[i] || [];
                                            if (t.name.startsWith('mismatch/age')) return true;
                                            return cd.length && cd[cd.length - 1].x >= step - 1; })); }"""
LINE_CHARTS = {"chart-system", "chart-reward", "chart-kl", "chart-resp-len", "chart-staleness",
               "chart-throughput", "chart-zero-var", "chart-greso", "chart-april", "chart-timing",
               "chart-actor"}
# a fake frame handed to the page's socket (the server's outage frames are tested in
# test_web_outage.py; here: what the page does with them)
SOCKETS = "window.__sockets = []; const _WS = window.WebSocket; window.WebSocket = function (u, p) {" \
          " const s = p === undefined ? new _WS(u) : new _WS(u, p); window.__sockets.push(s); return s; };" \
          " window.WebSocket.prototype = _WS.prototype; Object.assign(window.WebSocket, {OPEN: 1, CLOSED: 3});"
FEED = "m => { const s = window.__sockets[window.__sockets.length - 1]; s.onmessage({data: JSON.stringify(m)}); }"


def grows(name: str) -> int:
    """The distinct drawn point counts a trace must show while watched (a sporadic trace: fewer)."""
    return 3 if SPORADIC.match(name) else 10


def shot(page, shots, name):
    path = shots / f"{len(list(shots.glob('*.png'))):02d}-{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print("screenshot:", path)
    return path


def test_browser_flow(live_asgi, django_user_model, monkeypatch, tmp_path):
    assert shutil.which(CHROMIUM), (f"{CHROMIUM} is missing: `make test` installs it (apt-get install -y "
                                    "chromium) when run as root")
    from conftest import logged_in_page
    from playwright.sync_api import expect

    shots = Path(os.environ.get("RLPILOT_E2E_SCREENSHOT_DIR") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    django_user_model.objects.create_user("erin", password="erin-pw-123")
    # Playwright's sync API runs an event loop in this thread; the ORM is not used below
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    warnings = []

    def console(m):
        print("console:", m.type, m.text)
        if m.type == "warning" and "WebGL" in m.text:
            warnings.append(m.text)

    with logged_in_page(live_asgi, "erin", "erin-pw-123", viewport={"width": 1400, "height": 1000},
                        echo_errors=True, init_script=SOCKETS, on={"console": console}) as (page, errors):
        # launch: a per-field error first, then a valid tiny run with every technique on
        page.fill("#id_name", "e2e <i>run</i>")
        page.select_option("#id_preset", "all")
        page.click("details.section:has(#f-optim\\.lr) > summary")   # open [optim]
        page.fill("#f-optim\\.lr", "5")
        page.click("#launch-submit")
        expect(page.locator('[data-error-for="optim.lr"]')).to_contain_text("expected a number")
        page.fill("#f-optim\\.lr", "")
        page.evaluate("document.querySelectorAll('details.section').forEach(d => d.open = true)")
        for key, value in FORM.items():
            page.fill("#f-" + key.replace(".", "\\."), value)
        for key, value in FORM_SELECTS.items():
            page.select_option("#f-" + key.replace(".", "\\."), value)
        page.click("#launch-submit")
        page.wait_for_url(re.compile(r"/runs/\d+/$"))
        expect(page.locator("#run-name")).to_have_text("e2e <i>run</i>")   # escaped, shown as text

        # the tuning panel: the enabled techniques' key knobs first, open; the rest folded
        first = page.evaluate("() => [...document.querySelectorAll('#knob-rows tr[data-knob]')]"
                              ".slice(0, 4).map(tr => tr.dataset.knob)")
        assert first == ["async.max_staleness", "april.segment_max_tokens",
                         "april.over_sampling_batch_size", "greso.alpha"], first
        for knob in first:
            expect(page.locator(f'#knob-rows tr[data-knob="{knob}"]')).to_be_visible()
        expect(page.locator('#knob-rows tr[data-knob="optim.lr"]')).to_be_hidden()
        groups = page.evaluate("() => [...document.querySelectorAll('#knob-rows details')]"
                               ".map(d => [d.dataset.group, d.open])")
        assert groups[0] == ["key", True] and all(not o for _, o in groups[1:]), groups
        assert [g for g, _ in groups[1:4]] == ["async", "april", "greso"], groups

        expect(page.locator("#conn")).to_have_text("live")
        expect(page.locator("#run-status")).to_have_text("running", timeout=30_000)

        # what Plotly has drawn grows step by step: every line trace, over >= 10 steps
        seen: dict[tuple, list[int]] = {}
        steps, t0 = [], time.monotonic()
        while time.monotonic() - t0 < 40:
            step = int(page.locator("#run-step").inner_text() or 0)
            drawn = page.evaluate(DRAWN)
            if not steps or step != steps[-1]:
                steps.append(step)
            for chart, traces in drawn.items():
                for t in traces:
                    seen.setdefault((chart, t["name"]), []).append(t["n"])
            if LINE_CHARTS <= set(drawn) and len(steps) >= 12 and all(
                    len(set(v)) >= grows(name) for (_, name), v in seen.items()):
                break
            page.wait_for_timeout(150)
        print("steps seen:", steps[0], "...", steps[-1], f"({len(steps)})")
        missing = LINE_CHARTS - {c for c, _ in seen}
        assert not missing, f"line charts never drawn: {missing}"
        for (chart, name), ns in seen.items():
            assert ns == sorted(ns), f"{chart} {name}: drawn points went back: {ns}"
            assert len(set(ns)) >= grows(name), f"{chart} {name}: drawn point counts {sorted(set(ns))} (frozen?)"
        # paused, nothing new arrives: every line trace catches up with the page's step (while
        # running, a loaded machine may be a few steps behind between two draws)
        # the pause's reply (status "running", read when it was asked) is held back until the
        # stream has brought "paused": a late reply must not undo a newer status
        held = []
        page.route("**/api/runs/*/pause", lambda route: held.append((route, route.fetch())))
        page.click("#btn-pause")
        expect(page.locator("#run-status")).to_have_text("paused", timeout=60_000)
        route, reply = held.pop()
        print("held pause reply:", reply.json())   # {"status": "running", ...} as a rule
        route.fulfill(response=reply)
        expect(page.locator("#action-msg")).to_have_text("pause requested")
        expect(page.locator("#run-status")).to_have_text("paused")
        page.unroute("**/api/runs/*/pause")
        try:
            page.wait_for_function(CAUGHT_UP, timeout=30_000)
        except Exception:
            pass   # the assertion below says which trace lags
        final = page.evaluate(DRAWN)
        step = int(page.locator("#run-step").inner_text())
        for chart, traces in final.items():
            for t in traces:
                if SPORADIC.match(t["name"]):
                    continue
                assert t["last"] is not None and t["last"] >= step - 1, (chart, t, step)
        # the same for the resume's reply (status "paused" when asked)
        page.route("**/api/runs/*/resume", lambda route: held.append((route, route.fetch())))
        page.click("#btn-resume")
        expect(page.locator("#run-status")).to_have_text("running", timeout=60_000)
        route, reply = held.pop()
        route.fulfill(response=reply)
        expect(page.locator("#action-msg")).to_have_text("resume requested")
        expect(page.locator("#run-status")).to_have_text("running")
        page.unroute("**/api/runs/*/resume")
        # the system chart: CPU utilisation and RAM, drawn live, with real numbers
        system = {t["name"]: t for t in final["chart-system"]}
        assert set(system) == {"system/cpu_util", "system/ram_gb"}, system
        assert all(t["finite"] >= 10 for t in system.values()), system
        expect(page.locator("#chart-system")).to_contain_text("CPU")
        assert not warnings, warnings   # no WebGL context lost
        # the histograms and the heatmap: log colour, x axes in the right units
        expect(page.locator("#chart-len-heat")).not_to_have_class(re.compile("empty"))
        heat = page.evaluate("() => { const t = document.querySelector('#chart-len-heat').data[0];"
                             " return {z: Math.max(...t.z.flat()), text: Math.max(...t.text.flat()),"
                             " ticks: t.colorbar.ticktext}; }")
        assert heat["z"] < heat["text"] and heat["z"] == pytest.approx(math.log10(1 + heat["text"]))
        axes = page.evaluate("() => Object.fromEntries(['len-hist', 'staleness-hist', 'hist-april-version-span']"
                             ".map(id => [id, document.querySelector('#chart-' + id).layout.xaxis.title.text]))")
        assert "tokens" in axes["len-hist"], axes
        for h in ("staleness-hist", "hist-april-version-span"):
            assert "versions" in axes[h] and "tokens" not in axes[h], axes
        # asynchronous: no partial-rollout buffer (samples stay in flight), so no age chart
        assert page.evaluate("() => !document.querySelector('#chart-hist-april-buffer-age').layout")
        shot(page, shots, "live")

        # change knobs: pending, then applied from step N + 1, η moves, annotations on the charts
        page.click('#knob-rows details[data-group="optim"] > summary')
        page.fill('#knob-rows input[name="optim.lr"]', "3e-5")
        page.fill('#knob-rows input[name="async.max_staleness"]', "3")
        page.click("#knob-apply")
        change = page.locator("#knob-changes li").first
        expect(change).to_have_text(re.compile(r"applied from step \d+"), timeout=60_000)
        expect(page.locator('[data-current="optim.lr"]')).to_have_text(re.compile(r"^(3e-5|0\.00003)$"))
        expect(page.locator('[data-current="async.max_staleness"]')).to_have_text("3")
        expect(page.locator("#event-log")).to_contain_text("knob_applied")
        applied = page.locator("#event-log li", has_text="knob_applied").first
        for text in ("optim.lr: 0.0002 → 0.00003", "async.max_staleness: 2 → 3", "(by erin)"):
            expect(applied).to_contain_text(text)
        page.wait_for_function("() => (document.querySelector('#chart-staleness').layout.annotations || [])"
                               ".some(a => a.text === 'η = 3')")
        page.wait_for_function("() => (document.querySelector('#chart-reward').layout.annotations || [])"
                               ".some(a => a.text === '⚙' && /optim.lr/.test(a.hovertext))")
        # ... and the charts keep growing after that full redraw
        n = page.evaluate("() => document.querySelector('#chart-reward').calcdata[0].length")
        page.wait_for_function("n => document.querySelector('#chart-reward').calcdata[0].length >= n + 3", arg=n)

        # the stream notice (the server's outage frame) and a generic alert banner
        page.evaluate(FEED, {"type": "stream", "mode": "polling",
                             "message": "Live updates degraded <b>x</b>: polling the database every 1 s"})
        notice = page.locator("#stream-notice")
        expect(notice).to_be_visible()
        expect(notice).to_have_text("Live updates degraded <b>x</b>: polling the database every 1 s")
        page.evaluate(FEED, {"type": "event", "kind": "alert", "step": 7, "time": 0,
                             "data": {"rule": "stalled", "message": "no step for 120 s"}})
        expect(page.locator('#alerts li[data-rule="stalled"]')).to_have_text("stalled (step 7): no step for 120 s")
        expect(page.locator("#alerts")).to_be_visible()
        shot(page, shots, "live-degraded")
        page.evaluate(FEED, {"type": "stream", "mode": "live", "message": "Live updates restored"})
        expect(notice).to_be_hidden()
        page.evaluate(FEED, {"type": "event", "kind": "alert_cleared", "step": 8, "time": 0,
                             "data": {"rule": "stalled"}})
        expect(page.locator('#alerts li[data-rule="stalled"]')).to_have_count(0)

        # stop, its reply held back too (status "running" when asked) until the stream has
        # brought "stopped": the page must stay on "stopped"
        page.route("**/api/runs/*/stop", lambda route: held.append((route, route.fetch())))
        page.click("#btn-stop")
        expect(page.locator("#run-status")).to_have_text("stopped", timeout=60_000)
        route, reply = held.pop()
        route.fulfill(response=reply)
        expect(page.locator("#action-msg")).to_have_text("stop requested")
        expect(page.locator("#run-status")).to_have_text("stopped")
        page.unroute("**/api/runs/*/stop")
        expect(page.locator("#event-log")).to_contain_text("run_stopped")
        expect(page.locator("#btn-resume")).to_be_enabled()
        expect(page.locator("#alerts-title")).to_have_text("Alerts active when the run ended")

        # the report: the same charts, static; the knob change in the timeline; readable events
        run_id = int(re.search(r"/runs/(\d+)/", page.url).group(1))
        page.click("#report-link")
        page.wait_for_selector("body[data-charts-drawn='1']")
        expect(page.locator("#chart-reward")).not_to_have_class(re.compile("empty"))
        expect(page.locator("#chart-len-heat")).not_to_have_class(re.compile("empty"))
        drawn = page.evaluate(DRAWN)
        assert LINE_CHARTS <= set(drawn) and all(t["n"] >= 10 for t in drawn["chart-system"]), drawn
        expect(page.locator("#knob-timeline")).to_contain_text("optim.lr")
        expect(page.locator("#run-name")).to_have_text("e2e <i>run</i>")
        events = page.locator("#report-events")
        for text in ("optim.lr: 0.0002 → 0.00003", "async.max_staleness: 2 → 3", "(by erin)"):
            expect(events).to_contain_text(text)
        assert "{'" not in events.inner_text(), events.inner_text()[:2000]
        shot(page, shots, "report")

        # with a GPU (no GPU here: rows as the trainer writes them with NVML): the system chart
        # shows GPU utilisation and memory, one trace per device, drawn live as rows arrive
        from conftest import make_run

        from webapp.dashboard import actions
        from webapp.dashboard.actions import Record

        def gpu_rows(lo, hi):
            return [Record("points", s, "", {
                "system/gpu_util": 50.0 + s, "system/gpu_mem_gb": 20.0 + s / 10, "system/gpu_power_w": 300.0,
                **{f"system/gpu{i}/{m}": 10.0 * i + s for i in range(2) for m in ("util", "mem_gb", "power_w")}})
                for s in range(lo, hi)]

        erin = django_user_model.objects.get(username="erin")
        gpu = make_run(erin, "running", name="gpu <b>run</b>")
        actions.append(gpu.pk, gpu_rows(1, 4), {"step": 3}, ring_bell=False)
        page.goto(f"{live_asgi}/runs/{gpu.pk}/")
        expect(page.locator("#chart-system")).to_contain_text("GPU utilisation")
        page.wait_for_function("() => (document.querySelector('#chart-gpu-util').calcdata || [[]])[0].length === 3")
        for lo in range(4, 10, 2):   # embedded setup: the consumer polls the database
            actions.append(gpu.pk, gpu_rows(lo, lo + 2), {"step": lo + 1}, ring_bell=False)
            page.wait_for_function("n => ['#chart-system', '#chart-gpu-util', '#chart-gpu-mem', '#chart-gpu-power']"
                                   ".every(id => document.querySelector(id).calcdata.every(c => c.length === n))",
                                   arg=lo + 1)
        drawn = page.evaluate(DRAWN)
        assert [t["name"] for t in drawn["chart-gpu-util"]] == ["system/gpu0/util", "system/gpu1/util"]
        assert [t["name"] for t in drawn["chart-system"]] == ["system/gpu_util", "system/gpu_mem_gb"]
        shot(page, shots, "live-gpu")

        # compare it with a second (empty) run: one chart per chosen metric, EMA smoothing

        # a name with Plotly's markup subset: the legend shows it as text, not bold or a link
        other = make_run(erin, "finished", name='other <b>bold</b> <a href="http://x.invalid">l</a>')
        actions.append(other.pk, [Record("points", s, "", {"reward/mean": 0.1 * s})
                                  for s in range(1, 4)], {"step": 3}, ring_bell=False)
        page.goto(f"{live_asgi}/compare/?ids={run_id},{other.pk}")
        page.wait_for_selector("body[data-charts-drawn='1']")
        chart = page.locator('[data-metric="reward/mean"]')
        expect(chart.locator(".main-svg").first).to_be_attached()
        assert int(chart.get_attribute("data-npoints")) >= 3
        legend = chart.locator(".legendtext").all_text_contents()
        assert f'#{other.pk} other <b>bold</b> <a href="http://x.invalid">l</a>' in legend, legend
        assert chart.locator(".legendtext a, .legendtext tspan[style*='bold']").count() == 0
        page.fill("#ema", "0.9")
        page.dispatch_event("#ema", "input")
        expect(page.locator("#ema-value")).to_have_text("0.9")
        expect(page.locator("#config-diff")).to_contain_text("run.max_steps")
    assert not errors, errors
