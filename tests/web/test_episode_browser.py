"""Multi-turn episodes on the dashboard, in headless Chromium.

1. Written as the trainer's database sink writes them (no model needed): the episode charts draw
   their traces (counted in the SVG Plotly drew), the timeline draws a "tools" lane with "tool"
   bars however short the calls were, the tuning panel has the episode group, and the inspector
   shows an episode turn by turn: model turns and tool messages apart, the tool messages marked
   "not trained", the environment's tokens never labelled "v-1".
2. A real run of the `agent` preset (the built-in tools model, trainer/assets/builtin-tools)
   launched from the form on the session's Celery worker: the episode charts draw live, the
   inspector opens a real episode with a tool message, and episode.max_turns tuned mid-run is
   applied.
Screenshots: RLPILOT_EPISODE_SCREENSHOT_DIR (default /tmp/episodes)."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from helpers import sample_row

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.embedded_only]

SHOTS = Path(os.environ.get("RLPILOT_EPISODE_SCREENSHOT_DIR", "/tmp/episodes"))
EPISODE_CHARTS = {"episodes": ["episode/turns", "episode/turns/max", "episode/tool_use_rate",
                               "episode/max_turns_ratio"],
                  "tools": ["episode/tool_calls", "episode/tool_errors"],
                  "tool-time": ["episode/tool_s", "episode/env_tokens"]}

# per line chart: the traces Plotly drew (the d3 datum of each `g.trace` names it), their marker
# paths, whether the line has a path, and which y axis each is on
DRAWN = """id => { const gd = document.getElementById(id);
  if (!gd || !gd._fullLayout) return null;
  return [...gd.querySelectorAll('.scatterlayer .trace')].map(t => {
      const d = t.__data__ && t.__data__[0] && t.__data__[0].trace;
      const line = t.querySelector('.js-line');
      return {name: d ? d.name : null, axis: d ? d.yaxis : null, points: t.querySelectorAll('.points path').length,
              line: !!(line && (line.getAttribute('d') || '').length > 2)}; }); }"""
# the timeline: the lanes Plotly labelled, and per phase (legend order) the bars it drew, with
# their drawn width in pixels
TIMELINE = """() => { const gd = document.getElementById('timeline-chart');
  const ticks = [...gd.querySelectorAll('.yaxislayer-above .ytick text')].map(t => t.textContent);
  const traces = [...gd.querySelectorAll('.barlayer .trace.bars')].map(t => {
      const d = t.__data__ && t.__data__[0] && t.__data__[0].trace;
      return {phase: d ? d.name : null, widths: [...t.querySelectorAll('.point path')].map(p => p.getBBox().width)}; });
  return {lanes: ticks, traces: traces}; }"""
TURNS = """() => [...document.querySelectorAll('#sample-detail .turn')].map(t => ({
  role: t.dataset.role, trained: t.dataset.trained, head: t.querySelector('.turn-head').textContent,
  text: [...t.querySelectorAll('.tok')].map(x => x.textContent).join(''),
  versions: [...new Set([...t.querySelectorAll('.seg')].map(s => s.dataset.version))],
  bg: getComputedStyle(t).backgroundColor, border: getComputedStyle(t).borderLeftColor}))"""


def drawn(page, chart):
    return page.evaluate(DRAWN, "chart-" + chart) or []


def points(traces, name):
    return sum(t["points"] for t in traces if t["name"] == name)


def shot(page, name, locator=None):
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = str(SHOTS / f"{name}.png")
    (locator or page).screenshot(path=path, **({} if locator else {"full_page": True}))
    print("screenshot:", path)


# --- 1. as the sink writes it ---------------------------------------------------------------------

# a calculator episode: the model's call, the tool's result (environment: version -1), the answer
CALC = [("[23,58,7]=<calc>23+58+7</calc>", 3), ("<result>88</result>", -1), (">88", 3)]


def episode_row(step, pieces, group=1, index=0, **episode):
    tokens, segments, turns, logprobs, i = [], [], [], [], 0
    for text, v in pieces:
        tokens += list(text)
        logprobs += [0.0 if v == -1 else -0.05 - 0.4 * (k % 5) for k in range(len(text))]
        segments.append([v, len(text)])
        turns.append({"role": "tool" if v == -1 else "model", "start": i, "end": i + len(text), "trained": v != -1})
        i += len(text)
    row = sample_row(step, group=group, index=index, completion="".join(tokens), prompt="[23,58,7]=",
                     versions=tuple(map(tuple, segments)))
    row.update(logprobs=logprobs, turns=turns, episode={"turns": sum(v != -1 for _, v in pieces),
               "tool_calls": sum(v == -1 for _, v in pieces), "tool_errors": 0, "tool_s": 0.0002,
               "end": "answer", **episode})
    return row


def write_step(run, step):
    from webapp.dashboard.worker.telemetry import DbSink

    class Bell:
        def ring(self, run_id, seq):
            pass

        def close(self):
            pass

    t0 = 1_800_000_000.0 + 10 * step
    sink = DbSink(run.pk, doorbell=Bell())
    sink.scalars(step, {"reward/mean": 0.1 * step, "episode/turns": 1.5 + 0.1 * step, "episode/turns/max": 3,
                        "episode/tool_use_rate": 0.4 + 0.05 * step, "episode/max_turns_ratio": 0.05,
                        "episode/tool_calls": 20 + step, "episode/tool_errors": step % 2,
                        "episode/tool_s": 0.004, "episode/env_tokens": 300 + 10 * step})
    sink.timeline(step, [{"lane": "rank 0", "phase": "generating", "start": t0, "end": t0 + 6},
                         {"lane": "rank 0", "phase": "training", "start": t0 + 6, "end": t0 + 9},
                         {"lane": "engine", "phase": "generating", "start": t0, "end": t0 + 6, "occupancy": 0.7},
                         {"lane": "tools", "phase": "tool", "start": t0 + 1, "end": t0 + 1.0001},
                         {"lane": "tools", "phase": "tool", "start": t0 + 3, "end": t0 + 3.0002}])
    rows = [episode_row(step, CALC, group=step, index=0),
            episode_row(step, [("[23,58,7]=<calc>23+58+</calc>", 3), ("<result>error: bad expression</result>", -1),
                               ("<calc>23+58+7</calc>", 3), ("<result>88</result>", -1), (">88", 3)],
                        group=step, index=1, tool_errors=1),
            episode_row(step, [("[23,58,7]=81+7=88>88", 3)], group=step, index=2)]
    sink.samples(step, rows)
    with sink.lock:
        records, sink.buffer = sink.buffer, []
    sink._write(records)


def test_episodes_on_the_run_page_as_the_sink_writes_them(live_asgi, django_user_model, monkeypatch):
    from datetime import timedelta

    from conftest import CHROMIUM, logged_in_page, make_run
    from django.utils import timezone
    from playwright.sync_api import expect

    from trainer import config as config_mod
    from webapp.dashboard.models import RolloutSample, Run

    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing"
    user = django_user_model.objects.create_user("tess", password="tess-pw-123")
    run = make_run(user, "running", name="agent episodes", heartbeat_at=timezone.now() + timedelta(hours=1))
    cfg = config_mod.from_dict(config_mod.preset_dict("agent")).to_dict()
    Run.objects.filter(pk=run.pk).update(config=cfg, knobs={**run.knobs, "episode.max_turns": 3})
    for step in range(1, 5):
        write_step(run, step)

    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with logged_in_page(live_asgi, "tess", "tess-pw-123", viewport={"width": 1400, "height": 1000},
                        timeout_ms=20_000, echo_errors=True, dialogs="fail") as (page, errors):
        page.goto(f"{live_asgi}/runs/{run.pk}/")
        expect(page.locator("#conn")).to_have_text("live")
        # --- the episode charts: every trace drawn, one point per step, shares on the right axis
        for chart, keys in EPISODE_CHARTS.items():
            page.wait_for_selector(f"#chart-{chart} .scatterlayer .trace .points path")
            d = drawn(page, chart)
            assert {t["name"] for t in d} == set(keys), (chart, d)
            assert all(t["points"] == 4 and t["line"] for t in d), (chart, d)
        axes = {t["name"]: t["axis"] for t in drawn(page, "episodes")}
        assert axes == {"episode/turns": "y", "episode/turns/max": "y", "episode/tool_use_rate": "y2",
                        "episode/max_turns_ratio": "y2"}, axes
        assert {t["name"]: t["axis"] for t in drawn(page, "tool-time")} == {"episode/tool_s": "y",
                                                                           "episode/env_tokens": "y2"}
        page.locator("#chart-episodes").scroll_into_view_if_needed()
        shot(page, "01-episode-charts", page.locator("#chart-episodes"))

        # --- the timeline: a tools lane whose 0.1 ms calls are drawn a few pixels wide
        page.wait_for_selector("#timeline[data-loaded] #timeline-chart .barlayer .point path")
        tl = page.evaluate(TIMELINE)
        assert "tools" in tl["lanes"], tl
        tool = [t for t in tl["traces"] if t["phase"] == "tool"]
        assert tool and len(tool[0]["widths"]) == 8 and min(tool[0]["widths"]) >= 1.5, tl
        page.locator("#timeline").scroll_into_view_if_needed()
        shot(page, "02-timeline", page.locator("#timeline"))

        # --- the tuning panel: the episode knobs in their group, open for a multi-turn run
        group = page.locator('#knob-rows details[data-group="episode"]')
        expect(group.locator("summary .group-title")).to_have_text("Episodes: turns and tools")
        expect(group.locator("summary")).to_contain_text("multi-turn episodes")
        assert group.evaluate("d => d.open")
        assert "episode.max_turns" in group.locator("tr[data-knob]").evaluate_all("rs => rs.map(r => r.dataset.knob)")

        # --- the inspector: the table says turns; the episode opened turn by turn
        page.wait_for_function("() => +(document.getElementById('samples-panel').dataset.loaded || 0) > 0")
        two_calls = RolloutSample.objects.get(run=run, step=4, index=1)
        row = page.locator(f'#samples-table tr[data-sample="{two_calls.pk}"]')
        expect(row.locator(".turns-badge")).to_have_text(" · 3 turns · 2 tool calls (1 failed)")
        row.click()
        detail = page.locator("#sample-detail")
        expect(detail).to_have_attribute("data-sample", str(two_calls.pk))
        expect(detail.locator("h4").nth(1)).to_have_text("Episode, turn by turn")
        turns = page.evaluate(TURNS)
        assert [(t["role"], t["trained"]) for t in turns] == [
            ("model", "true"), ("tool", "false"), ("model", "true"), ("tool", "false"), ("model", "true")], turns
        assert [t["text"] for t in turns] == ["[23,58,7]=<calc>23+58+</calc>", "<result>error: bad expression</result>",
                                              "<calc>23+58+7</calc>", "<result>88</result>", ">88"]
        assert [t["head"] for t in turns][:2] == ["Model turn 1 · 29 tokenstrained",
                                                 "Tool message · 38 tokensnot trained · written by the environment"]
        assert all(t["versions"] == ["-1"] for t in turns if t["role"] == "tool")
        assert all(t["versions"] == ["3"] for t in turns if t["role"] == "model")
        model, tool = turns[0], turns[1]
        assert model["bg"] != tool["bg"] and model["border"] != tool["border"]   # visibly apart
        # model tokens shaded by their version; the environment's by no version
        segs = page.evaluate("""() => [...document.querySelectorAll('#sample-detail .turn .seg')].map(s =>
            ({v: s.dataset.version, bg: s.style.background, title: s.title}))""")
        assert all(s["bg"] for s in segs if s["v"] == "3") and not any(s["bg"] for s in segs if s["v"] == "-1")
        assert all(s["title"].startswith("environment (not trained)") for s in segs if s["v"] == "-1"), segs
        legend = detail.locator(".sample-legend")
        expect(legend).to_contain_text("3 segments by 1 policy version")
        expect(legend.locator('.swatch[data-legend-version="-1"]')).to_have_text("environment (not trained) · 57 tok")
        assert "v-1" not in detail.inner_text()
        expect(detail.locator('.sample-meta [data-field="episode"] dd')).to_have_text(
            "3 model turns · 2 tool calls (1 failed) · 0.0002 s in tools · answered")
        expect(detail.locator('.sample-meta [data-field="finish"] dd')).to_have_text("stop")
        expect(detail.locator(".detail-group .member")).to_have_count(2)
        expect(detail.locator(".detail-group")).to_contain_text("1 turn · 0 tool calls")
        detail.scroll_into_view_if_needed()
        shot(page, "03-inspector-episode", detail)
        # shaded by log-probability: the environment's tokens stay unshaded (no policy sampled them)
        page.click("#shade-toggle")
        bgs = page.evaluate("""() => [...document.querySelectorAll('#sample-detail .turn')].map(t =>
            [t.dataset.role, [...t.querySelectorAll('.tok')].filter(x => x.style.background).length,
             t.querySelectorAll('.tok').length])""")
        assert all((n == 0) if role == "tool" else (n == total) for role, n, total in bgs), bgs
        shot(page, "04-inspector-logprob", detail)
        shot(page, "05-page")

        # --- the report page, the offline HTML export and the comparison draw them too
        Run.objects.filter(pk=run.pk).update(status="stopped")
        page.goto(f"{live_asgi}/runs/{run.pk}/report/")
        page.wait_for_selector("body[data-charts-drawn='1']")
        for chart, keys in EPISODE_CHARTS.items():
            assert {t["name"]: t["points"] for t in drawn(page, chart)} == dict.fromkeys(keys, 4), chart
        page.wait_for_selector("#timeline-totals .barlayer .point path")
        share = page.evaluate("""() => { const gd = document.getElementById('timeline-totals');
            const lanes = gd.data[0].y, t = gd.data.find(d => d.name === 'tool');
            return t ? Object.fromEntries(lanes.map((l, i) => [l, t.x[i]])) : null; }""")
        assert share and share["tools"] > 0 and not share["rank 0"], share   # the tools lane's share counted
        export = page.request.get(f"{live_asgi}/api/runs/{run.pk}/export?format=html")
        assert export.ok
        page.set_content(export.text())
        page.wait_for_selector("body[data-charts-drawn='1']")
        for chart, keys in EPISODE_CHARTS.items():
            assert {t["name"]: t["points"] for t in drawn(page, chart)} == dict.fromkeys(keys, 4), chart
        assert page.locator("#report-samples .turn-tool").count() == 12   # 1 + 2 tool messages a step, 4 steps
        opened = page.locator("#report-samples tr:has(.turn-tool) details").last
        opened.evaluate("d => d.open = true")
        expect(opened.locator(".turn-tool .turn-label").first).to_have_text("tool (environment, not trained)")
        shot(page, "06-export-episode", page.locator("#report-samples tr:has(.turn-tool)").last)
        plain = make_run(user, "finished", name="single-turn")   # the comparison takes 2 to 8 runs
        page.goto(f"{live_asgi}/compare/?ids={run.pk},{plain.pk}")
        page.wait_for_selector("body[data-charts-drawn='1']")
        for key in ("episode/turns", "episode/tool_use_rate"):
            assert page.is_checked(f'#metric-picks input[value="{key}"]'), key
            page.wait_for_selector(f'#compare-charts div[data-metric="{key}"] .scatterlayer .points path')
    assert not errors, errors


# --- 2. a real run of the agent preset --------------------------------------------------------------

def _tools_model() -> Path:
    from trainer.models.loading import BUILTIN_TOOLS, builtin_dir

    return builtin_dir(BUILTIN_TOOLS) / "model.safetensors"


@pytest.mark.timeout(600)
def test_an_agent_run_launched_from_the_form_shows_its_episodes(live_asgi, django_user_model, monkeypatch, tiny,
                                                              wait_until):
    from conftest import CHROMIUM, logged_in_page, submit_launch_form
    from django.conf import settings
    from playwright.sync_api import expect

    from webapp.dashboard.models import KnobChange, MetricPoint, RolloutSample, Run

    fields = {k: str(v) for k, v in tiny.items() if k != "rollout.max_response_len"}   # the preset's 96
    # RLPILOT_TEST_TOOLS_MODEL: another warmed-up tools model (`warmup --tools --out DIR`), copied
    # into the server's model roots and named in the form, e.g. before the shipped one exists
    other = os.environ.get("RLPILOT_TEST_TOOLS_MODEL")
    if other:
        dest = Path(settings.VAR_DIR) / "models" / "tools-under-test"
        shutil.copytree(other, dest, dirs_exist_ok=True)
        fields["model.path"] = str(dest)
    elif not _tools_model().is_file():
        pytest.skip(f"no {_tools_model()} (python -m trainer warmup --tools)")
    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing"
    django_user_model.objects.create_user("ada", password="ada-pw-123")
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")   # Playwright's loop runs in this thread
    with logged_in_page(live_asgi, "ada", "ada-pw-123", viewport={"width": 1400, "height": 1000},
                        timeout_ms=30_000, dialogs="accept") as (page, errors):
        page.evaluate("document.querySelectorAll('details.section').forEach(d => d.open = true)")
        page.select_option("#id_preset", "agent")
        # the [episode] section of the form, with the preset's values as placeholders
        expect(page.locator("#f-episode\\.max_turns")).to_have_attribute("placeholder", "3")
        page.fill("#id_name", "agent episodes")
        rid = submit_launch_form(page, {**fields, "run.max_steps": "60", "run.log_samples": "2"})
        run = Run.objects.get(pk=rid)
        assert run.preset == "agent" and run.config["episode"]["max_turns"] == 3
        assert run.config["episode"]["tools"] == "calculator"
        expect(page.locator("#run-status")).to_have_text("running", timeout=120_000)

        # --- the episode charts draw live, every trace, one point per step
        def charted():
            for chart, keys in EPISODE_CHARTS.items():
                d = drawn(page, chart)
                if {t["name"] for t in d} != set(keys) or min(t["points"] for t in d) < 2:
                    return False
            return True
        wait_until(charted, 300, "the episode charts to draw 2 points per trace")
        d = drawn(page, "episodes")
        assert len({t["points"] for t in d}) == 1 and all(t["line"] for t in d), d
        turns_max = MetricPoint.objects.filter(run_id=rid, key="episode/turns/max")
        assert turns_max.exists() and all(1 <= v <= 3 for v in turns_max.values_list("value", flat=True))

        # --- a real episode with a tool message, opened in the inspector
        def with_tool():
            return next((s for s in RolloutSample.objects.filter(run_id=rid).order_by("-id")
                         if any(t["role"] == "tool" for t in s.turns)), None)
        wait_until(with_tool, 240, "a recorded episode that called the calculator")
        sample = with_tool()
        page.fill('#samples-filters [name="min_step"]', str(sample.step))
        page.fill('#samples-filters [name="max_step"]', str(sample.step))
        page.click("#samples-apply")
        page.click(f'#samples-table tr[data-sample="{sample.pk}"]')
        detail = page.locator("#sample-detail")
        expect(detail).to_have_attribute("data-sample", str(sample.pk))
        turns = page.evaluate(TURNS)
        assert [t["role"] for t in turns] == [t["role"] for t in sample.turns], (turns, sample.turns)
        tool = [t for t in turns if t["role"] == "tool"]
        model = [t for t in turns if t["role"] == "model"]
        assert tool and model and all(t["trained"] == "false" and "not trained" in t["head"] for t in tool)
        assert all(t["text"].startswith("<result>") and t["versions"] == ["-1"] for t in tool), tool
        assert all(t["trained"] == "true" and "-1" not in t["versions"] for t in model), model
        assert model[0]["bg"] != tool[0]["bg"] and model[0]["border"] != tool[0]["border"]
        assert "".join(t["text"] for t in turns) == "".join(sample.tokens)
        expect(detail.locator('.sample-meta [data-field="finish"] dd')).not_to_have_text("partial")
        assert "v-1" not in detail.inner_text()
        detail.scroll_into_view_if_needed()
        shot(page, "11-live-inspector", detail)

        # --- the tools lane on the timeline
        page.wait_for_selector("#timeline[data-loaded] #timeline-chart .barlayer .point path")
        wait_until(lambda: "tools" in page.evaluate(TIMELINE)["lanes"], 60, "the timeline's tools lane")

        # --- episode.max_turns tuned mid-run: applied, and later episodes keep to it
        group = page.locator('#knob-rows details[data-group="episode"]')
        expect(group.locator("summary .group-title")).to_have_text("Episodes: turns and tools")
        expect(page.locator('[data-current="episode.max_turns"]')).to_have_text("3")
        page.fill('#knob-rows input[name="episode.max_turns"]', "2")
        page.click("#knob-apply")
        expect(page.locator("#knob-changes li").first).to_have_text(re.compile(r"applied from step \d+"),
                                                                    timeout=120_000)
        expect(page.locator('[data-current="episode.max_turns"]')).to_have_text("2")
        change = KnobChange.objects.get(run_id=rid, status=KnobChange.APPLIED)
        at = change.applied_step
        after = MetricPoint.objects.filter(run_id=rid, key="episode/turns/max", step__gt=at + 1)
        wait_until(lambda: after.count() >= 2, 240, "two steps after the change")
        assert all(v <= 2 for v in after.values_list("value", flat=True)), list(after.values_list("step", "value"))
        page.locator("#chart-episodes").scroll_into_view_if_needed()
        shot(page, "12-live-episode-charts", page.locator("#chart-episodes"))
        shot(page, "13-live-page")

        page.click("#btn-kill")
        expect(page.locator("#run-status")).to_have_text("stopped", timeout=60_000)
    assert not errors, errors


@pytest.fixture(autouse=True)
def _no_run_left_behind(django_user_model):
    """A failure above leaves its run running on the session's worker: killed here."""
    yield
    from conftest import kill_active_runs

    kill_active_runs("ada")
