"""The rollout inspector in headless Chromium (the fixtures and browser of test_web_e2e.py): a run
with every technique on (preset `all`) and rows as its database sink writes them; filter to the
longest samples; click a bar of the length histogram, a cell of the length heatmap and a point of
the reward chart and see that step's samples; open one and see its version segments and its
group; a `<script>` completion shows as text and runs nothing; new samples arrive over the
socket; the report page has the same panel. Screenshots go to RLPILOT_INSPECTOR_SCREENSHOT_DIR
(default /tmp/inspector)."""
import os
import re
import shutil
from pathlib import Path

import pytest
from helpers import sample_row

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.embedded_only]

EVIL = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
EDGES = [0, 8, 16, 24, 32, 40]


def rows_for(step):
    """Two whole groups of 4, the step's longest again, and at step 4 an APRIL sample resumed
    across three policy versions, a reward timeout and a `<script>` completion."""
    rows = []
    for g in range(2):
        for k in range(4):
            n = 3 + (step * 5 + g * 11 + k * 7) % 36
            rows.append(sample_row(step, group=100 * step + g, index=k, length=n, reward=float((k + g) % 2),
                                   versions=((step, n),), finish="length" if n >= 36 else "stop"))
    rows.append({**max(rows, key=lambda r: r["length"]), "why": "longest"})
    if step == 4:
        rows.append(sample_row(4, group=9001, index=4, versions=((1, 5), (2, 6), (4, 9)), finish="partial",
                               staleness=2, reward=1.0, why="group"))
        rows.append(sample_row(4, group=9002, index=0, completion=EVIL, reward=None, score=None,
                               reward_status="timeout", reward_error="verifier timed out after 5 s", why="error"))
    return rows


def hist(rows):
    counts = [0] * (len(EDGES) - 1)
    for r in rows:
        if r["why"] == "longest":
            continue
        counts[min(len(counts) - 1, r["length"] // 8)] += 1
    return {"edges": EDGES, "counts": counts}


def click_data(page, chart, x, y):
    """A real mouse click where Plotly draws the data point (x, y) of `chart`."""
    box = page.evaluate("""([id, x, y]) => { const gd = document.getElementById(id);
        gd.scrollIntoView({block: "center"});
        const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis, r = gd.getBoundingClientRect();
        return {x: r.left + xa._offset + xa.d2p(x), y: r.top + ya._offset + ya.d2p(y)}; }""", [chart, x, y])
    page.mouse.click(box["x"], box["y"])


def table(page):
    return page.evaluate("""() => [...document.querySelectorAll('#samples-table tr.sample-row')].map(tr =>
        ({id: +tr.dataset.sample, step: +tr.dataset.step, length: +tr.dataset.length,
          cells: [...tr.children].map(td => td.textContent)}))""")


def wait_loaded(page, after):
    page.wait_for_function("n => +(document.getElementById('samples-panel').dataset.loaded || 0) > n"
                           " && !document.getElementById('samples-panel').dataset.loading", arg=after)
    return int(page.get_attribute("#samples-panel", "data-loaded"))


def loaded(page):
    return int(page.get_attribute("#samples-panel", "data-loaded") or 0)


def test_rollout_inspector_in_the_browser(live_asgi, django_user_model, monkeypatch):
    from conftest import CHROMIUM, logged_in_page

    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing"
    from conftest import make_run
    from playwright.sync_api import expect

    from trainer import config as config_mod
    from webapp.dashboard.models import RolloutSample, Run
    from webapp.dashboard.worker.telemetry import DbSink

    shots = Path(os.environ.get("RLPILOT_INSPECTOR_SCREENSHOT_DIR", "/tmp/inspector"))
    shots.mkdir(parents=True, exist_ok=True)

    def shot(page, name):
        path = shots / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        print("screenshot:", path)

    user = django_user_model.objects.create_user("ivy", password="ivy-pw-123")
    from datetime import timedelta

    from django.utils import timezone

    # a worker that beats for the next hour (the stale-run sweep leaves the run running)
    run = make_run(user, "running", name="inspector <b>run</b>", heartbeat_at=timezone.now() + timedelta(hours=1))
    Run.objects.filter(pk=run.pk).update(config=config_mod.from_dict(config_mod.preset_dict("all")).to_dict())

    class Bell:
        def ring(self, run_id, seq):
            pass

        def close(self):
            pass

    def write_step(step):
        """One step as the trainer's database sink writes it: scalars, the length histogram, samples."""
        rows = rows_for(step)
        sink = DbSink(run.pk, doorbell=Bell())
        sink.scalars(step, {"reward/mean": 0.1 * step, "rollout/response_len/mean": 10.0 + step,
                            "rollout/response_len/max": max(r["length"] for r in rows)})
        sink.histogram(step, "rollout/response_len", hist(rows))
        sink.samples(step, rows)
        with sink.lock:
            records, sink.buffer = sink.buffer, []
        sink._write(records)
        return rows

    written = {s: write_step(s) for s in range(1, 7)}

    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with logged_in_page(live_asgi, "ivy", "ivy-pw-123", viewport={"width": 1400, "height": 1000},
                        timeout_ms=20_000, echo_errors=True, dialogs="fail") as (page, errors):
        page.goto(f"{live_asgi}/runs/{run.pk}/")
        expect(page.locator("#conn")).to_have_text("live")
        n = wait_loaded(page, 0)
        total = RolloutSample.objects.filter(run=run).count()
        rows = table(page)
        assert len(rows) == min(50, total) and rows[0]["step"] == 6    # newest step first
        page.wait_for_selector("#chart-len-hist .main-svg")

        # the longest samples first
        page.click("#samples-longest")
        n = wait_loaded(page, n)
        lengths = [r["length"] for r in table(page)]
        longest = max(r["length"] for rs in written.values() for r in rs)
        assert lengths[0] == longest and lengths == sorted(lengths, reverse=True), lengths
        shot(page, "01-longest")

        # a bar of the length histogram (it shows the latest step, 6): that step and that bin
        counts = hist(written[6])["counts"]
        b = max(range(len(counts)), key=lambda i: counts[i])
        x = page.evaluate("() => document.getElementById('chart-len-hist').data[0].x")[b]
        click_data(page, "chart-len-hist", x, counts[b] / 2)
        n = wait_loaded(page, n)
        got = table(page)
        lo, hi = EDGES[b], EDGES[b + 1]
        expected = sorted(r["length"] for r in written[6]
                          if (b == 0 or r["length"] >= lo) and (b == len(counts) - 1 or r["length"] < hi))
        assert got and {r["step"] for r in got} == {6}, got
        assert sorted(r["length"] for r in got) == expected
        assert page.input_value('#samples-filters [name="min_step"]') == "6"
        shot(page, "02-histogram-bar")

        # a cell of the heatmap: step 4, the first bin
        xs = page.evaluate("() => document.getElementById('chart-len-heat').data[0].x")
        click_data(page, "chart-len-heat", xs[0], 4)
        n = wait_loaded(page, n)
        got = table(page)
        assert got and {r["step"] for r in got} == {4} and all(r["length"] < 8 for r in got), got
        # a point of the reward chart: step 3, every length
        click_data(page, "chart-reward", 3, 0.3)
        n = wait_loaded(page, n)
        got = table(page)
        assert {r["step"] for r in got} == {3} and len(got) == len(written[3])

        # step 4 whole, then open the APRIL sample that three policy versions wrote
        page.fill('#samples-filters [name="min_step"]', "4")
        page.fill('#samples-filters [name="max_step"]', "4")
        page.fill('#samples-filters [name="min_len"]', "")
        page.fill('#samples-filters [name="max_len"]', "")
        page.click("#samples-apply")
        n = wait_loaded(page, n)
        april = RolloutSample.objects.get(run=run, finish="partial")
        page.click(f'#samples-table tr[data-sample="{april.pk}"]')
        detail = page.locator("#sample-detail")
        expect(detail).to_have_attribute("data-sample", str(april.pk))
        segs = page.evaluate("""() => [...document.querySelectorAll('#sample-detail .completion .seg')]
            .map(s => ({v: s.dataset.version, n: s.querySelectorAll('.tok').length,
                        bg: getComputedStyle(s).backgroundColor}))""")
        assert [(s["v"], s["n"]) for s in segs] == [("1", 5), ("2", 6), ("4", 9)], segs
        assert len({s["bg"] for s in segs}) == 3, segs              # three different shadings
        expect(detail.locator(".sample-legend .swatch")).to_have_count(3)
        expect(detail.locator(".sample-legend")).to_contain_text("parked and resumed")
        expect(detail.locator(".sample-meta")).to_contain_text("staleness")
        assert detail.locator(".completion").inner_text() == april.completion
        # its group: the other members recorded with it (none here), then a whole group
        expect(detail.locator(".detail-group")).to_contain_text("No other member")
        shot(page, "03-april-sample")
        page.click("#shade-toggle")
        bgs = page.evaluate("() => [...document.querySelectorAll('#sample-detail .completion .tok')]"
                            ".map(t => t.style.background)")
        assert len(bgs) == 20 and len(set(bgs)) > 1 and all(bgs), bgs   # shaded by log-probability
        expect(page.locator("#sample-detail .completion")).to_have_attribute("data-mode", "logprob")
        shot(page, "04-logprob-shading")

        member = RolloutSample.objects.filter(run=run, step=4, group=400, why="group").order_by("index")[1]
        page.click(f'#samples-table tr[data-sample="{member.pk}"]')
        expect(detail).to_have_attribute("data-sample", str(member.pk))
        cards = detail.locator(".detail-group .member")
        expect(cards).to_have_count(3)
        rewarded = RolloutSample.objects.filter(run=run, step=4, group=400, why="group", reward__gt=0) \
            .exclude(pk=member.pk).count()
        expect(detail.locator(".detail-group .member.got-reward")).to_have_count(rewarded)
        expect(detail.locator(".detail-group .member.no-reward")).to_have_count(3 - rewarded)
        shot(page, "05-group")

        # a completion holding <script>: shown as text, nothing runs
        evil = RolloutSample.objects.get(run=run, reward_status="timeout")
        page.fill('#samples-filters [name="q"]', "__pwned")
        page.click("#samples-apply")
        n = wait_loaded(page, n)
        got = table(page)
        assert [r["id"] for r in got] == [evil.pk]
        assert EVIL[:60] in got[0]["cells"][-1]
        page.click(f'#samples-table tr[data-sample="{evil.pk}"]')
        expect(detail).to_have_attribute("data-sample", str(evil.pk))
        assert detail.locator(".completion").inner_text() == EVIL
        expect(detail.locator(".sample-meta")).to_contain_text("timeout: verifier timed out after 5 s")
        assert page.locator("#samples-panel script, #samples-panel img").count() == 0
        assert page.evaluate("() => window.__pwned") is None
        shot(page, "06-script-as-text")

        # new samples arrive over the socket (newest-first view)
        page.click("#samples-reset")
        n = wait_loaded(page, n)
        write_step(7)
        page.wait_for_function("() => document.querySelector('#samples-table tr.sample-row').dataset.step === '7'")
        assert {r["id"] for r in table(page) if r["step"] == 7} == set(
            RolloutSample.objects.filter(run=run, step=7).values_list("id", flat=True))
        # the live rows get their text, and the charts keep drawing the new step
        step7 = RolloutSample.objects.filter(run=run, step=7).order_by("id").first()
        expect(page.locator(f'#samples-table tr[data-sample="{step7.pk}"] td.preview')).to_have_text(
            step7.completion)
        page.wait_for_function("() => document.querySelector('#chart-reward').calcdata[0].length === 7")
        expect(page.locator("#chart-len-hist")).to_contain_text("step 7")
        shot(page, "07-live")

        # the report page: the same panel and chart clicks
        Run.objects.filter(pk=run.pk).update(status="stopped")   # (no doorbell from Playwright's loop)
        page.goto(f"{live_asgi}/runs/{run.pk}/report/")
        page.wait_for_selector("body[data-charts-drawn='1']")
        wait_loaded(page, 0)
        assert table(page)[0]["step"] == 7
        click_data(page, "chart-reward", 2, 0.2)
        page.wait_for_function("() => [...document.querySelectorAll('#samples-table tr.sample-row')]"
                               ".every(tr => tr.dataset.step === '2')")
        page.click("#samples-table tr.sample-row >> nth=0")
        expect(page.locator("#sample-detail .completion .seg").first).to_be_visible()
        shot(page, "08-report")
        assert re.search(r"samples CSV", page.locator("#exports").inner_text())
    assert not errors, errors
