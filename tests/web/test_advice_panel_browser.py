"""The advice panel of the live page in headless Chromium (the browser of test_web_e2e.py): a run
whose metrics trigger three pieces of advice (test_advice_panel.advice_rows); each listed with
its move, confidence, expected effect and evidence; a click on an evidence figure shades its
steps on the chart of that metric (the rectangle in the Plotly layout of the drawn chart);
Apply -> pending, then the trainer's knob_applied for it (through the trainer's own boundary
code) -> "applied from step 31"; Dismiss hides another, after a reload too; the autopilot's
checkboxes send pilot.autopilot; the autopilot's own change reads as text in the event log; a
watcher sees the advice without the buttons; the report lists what happened. Screenshots:
/tmp/advice-*.png."""
import shutil

import pytest

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.embedded_only]

SHOTS = "/tmp/advice-{}.png"


def item(page, key):
    return page.locator(f'#advice-list li[data-key="{key}"]')


def evidence_shapes(page, chart_id):
    """The advice highlight rectangles Plotly holds for a chart, and how many shape paths it drew."""
    return page.evaluate("""id => { const gd = document.getElementById(id);
        const rects = (gd._fullLayout.shapes || []).filter(s => s.type === "rect" && s.name === "advice-evidence")
            .map(s => ({x0: s.x0, x1: s.x1, xref: s.xref, yref: s.yref}));
        return {rects: rects, drawn: gd.querySelectorAll(".shapelayer path").length}; }""", chart_id)


def test_the_advice_panel_in_the_browser(live_asgi, django_user_model, monkeypatch):
    from conftest import CHROMIUM, browser_login, logged_in_page, make_run, prepare_page, wait_until
    from playwright.sync_api import expect
    from test_advice_panel import advice_rows, trainer_applies

    from trainer.config import AUTOPILOT_RULES
    from webapp.dashboard import actions
    from webapp.dashboard.actions import Record
    from webapp.dashboard.models import KnobChange, Run, RunEvent
    from webapp.dashboard.reports import advice

    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing"
    owner = django_user_model.objects.create_user("erin", password="erin-pw-123")
    django_user_model.objects.create_user("frank", password="frank-pw-123")
    run = make_run(owner, "running", name="advised <b>run</b>")
    actions.append(run.pk, advice_rows(), {"step": 30})
    run.refresh_from_db()
    by_reason = {a["reason"]: a for a in advice.for_run(run, 20)["advice"]}
    kl, entropy, length = by_reason["kl_runaway"], by_reason["entropy_collapse"], by_reason["responses_truncated"]

    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")   # Playwright's loop runs in this thread
    with logged_in_page(live_asgi, "erin", "erin-pw-123", viewport={"width": 1500, "height": 1100},
                        timeout_ms=20_000) as (page, errors):
        page.goto(f"{live_asgi}/runs/{run.pk}/")
        expect(page.locator("#conn")).to_have_text("live")
        page.wait_for_selector("#chart-kl .main-svg")

        # --- the advice, each with its move, confidence, expected effect and evidence
        expect(page.locator("#advice-steps")).to_have_text("steps 11–30")
        expect(page.locator("#advice-list > li")).to_have_count(3)
        kl_item = item(page, kl["evidence_key"])
        expect(kl_item).to_contain_text(kl["message"])
        expect(kl_item.locator(".advice-move")).to_have_text("algo.kl_coef: 0 → 0.01")
        expect(kl_item).to_contain_text(f"{kl['confidence']} confidence")
        expect(kl_item).to_contain_text("expected: " + kl["expected"])
        expect(kl_item.locator(".evidence button")).to_have_text([
            "actor/kl last = 0.8 (steps 11–30)", "actor/kl median, first half = 0.1 (steps 11–30)",
            "actor/kl median, second half = 0.8 (steps 11–30)"])
        expect(item(page, length["evidence_key"]).locator(".advice-move")).to_have_text(
            "no knob: responses truncated")
        expect(item(page, length["evidence_key"]).locator(".advice-apply")).to_have_count(0)
        assert evidence_shapes(page, "chart-kl")["rects"] == []

        # --- a figure shades its steps on the chart of its metric
        kl_item.locator(".evidence button").first.click()
        wait_until(lambda: evidence_shapes(page, "chart-kl")["rects"], 10, "the highlight on the KL chart")
        shapes = evidence_shapes(page, "chart-kl")
        assert shapes["rects"] == [{"x0": 10.5, "x1": 30.5, "xref": "x", "yref": "paper"}], shapes
        assert shapes["drawn"] >= 1
        expect(kl_item.locator(".evidence button.shown")).to_have_count(1)
        page.screenshot(path=SHOTS.format("01-panel-and-highlight"), full_page=True)
        page.locator("#advice").screenshot(path=SHOTS.format("01b-panel"))
        # another figure, on another chart: the first highlight goes
        p90 = '.evidence button[data-metric="rollout/response_len/p90"]'
        item(page, length["evidence_key"]).locator(p90).click()
        wait_until(lambda: evidence_shapes(page, "chart-resp-len")["rects"], 10, "the response-length highlight")
        wait_until(lambda: not evidence_shapes(page, "chart-kl")["rects"], 10, "the KL highlight cleared")
        # a metric without a chart says so
        item(page, entropy["evidence_key"]).locator(".evidence button").first.click()
        expect(page.locator("#advice-msg")).to_contain_text("actor/entropy has no chart on this page")

        # --- Apply: pending, then the trainer applies it at its step boundary
        kl_item.locator(".advice-apply").click()
        expect(kl_item.locator(".advice-state")).to_have_text("pending: applies at the next step boundary")
        change = wait_until(lambda: KnobChange.objects.filter(run=run).first(), 10, "the knob change")
        assert change.knobs == {"algo.kl_coef": 0.01}
        assert change.advice == {"rule": "health", "reason": "kl_runaway", "evidence_key": kl["evidence_key"]}
        expect(page.locator(f"#kc-{change.change_id}")).to_have_text("pending: algo.kl_coef = 0.01")
        page.screenshot(path=SHOTS.format("02-apply-pending"), full_page=True)
        trainer_applies(Run.objects.get(pk=run.pk), 30)
        expect(kl_item).to_contain_text("applied from step 31")
        expect(page.locator("#event-log")).to_contain_text("algo.kl_coef: 0 → 0.01 (by erin, from health advice)")
        # the trainer goes on: the advice is read again and starts from the new value, a new item,
        # while the applied one stays
        more = advice_rows(31, 40)
        for r in more:
            r.values["perf/trained_tokens_per_s"] = 180.0
        actions.append(run.pk, more, {"step": 40})
        expect(page.locator("#advice-steps")).to_have_text("steps 21–40")
        expect(page.locator('#advice-list li[data-rule="health"] .advice-move')).to_have_text(
            ["algo.kl_coef: 0.01 → 0.02"])
        expect(kl_item).to_contain_text("applied from step 31")
        expect(kl_item).to_contain_text(kl["message"])
        expect(item(page, entropy["evidence_key"])).to_have_count(0)   # no collapse within steps 21-40

        # --- Dismiss hides the length advice, after a reload too
        item(page, length["evidence_key"]).locator(".advice-dismiss").click()
        expect(item(page, length["evidence_key"])).to_have_count(0)
        expect(page.locator("#advice-empty")).to_be_hidden()
        dismissed = RunEvent.objects.get(run=run, kind="advice_dismissed")
        assert dismissed.data["evidence_key"] == length["evidence_key"] and dismissed.data["requested_by"] == "erin"
        expect(page.locator("#event-log")).to_contain_text("dismissed length advice: no knob (by erin)")
        page.screenshot(path=SHOTS.format("03-applied-and-dismissed"), full_page=True)
        page.reload()
        expect(page.locator("#conn")).to_have_text("live")
        expect(page.locator("#advice-steps")).to_have_text("steps 21–40")
        expect(item(page, length["evidence_key"])).to_have_count(0)
        expect(item(page, kl["evidence_key"])).to_contain_text("applied from step 31")

        # --- the autopilot: a checkbox per rule sends pilot.autopilot, a list knob
        expect(page.locator("#autopilot-rules input")).to_have_count(len(AUTOPILOT_RULES))
        expect(page.locator("#autopilot-state")).to_have_text("off: advice only")
        page.check('#autopilot-rules input[value="staleness"]')
        expect(page.locator("#autopilot-state")).to_have_text("pending: applies at the next step boundary")
        auto = wait_until(lambda: KnobChange.objects.filter(run=run, knobs__has_key="pilot.autopilot").first(),
                          10, "the autopilot change")
        assert auto.knobs == {"pilot.autopilot": ["staleness"]} and auto.advice is None
        trainer_applies(Run.objects.get(pk=run.pk), 40)
        expect(page.locator("#autopilot-state")).to_have_text("on for staleness")
        expect(page.locator('#autopilot-rules input[value="staleness"]')).to_be_checked()
        expect(page.locator('#autopilot-rules input[value="april"]')).not_to_be_checked()
        # the tuning panel shows the list knob as text, typed comma-separated
        knob = page.locator('#knob-rows input[name="pilot.autopilot"]')
        expect(knob).to_have_attribute("type", "text")
        expect(page.locator('[data-current="pilot.autopilot"]')).to_have_text("staleness")
        # the trainer's advice and the autopilot's own change, as the trainer records them:
        # readable in the event log
        eta = {"rule": "staleness", "reason": "eta_starves_generation", "evidence_key": "0123456789ab",
               "message": "eta holds generation back"}
        actions.append(run.pk, [
            Record("event", 40, "advice", {**eta, "knob": "async.max_staleness", "current": 0, "proposed": 1,
                                           "expected": "more throughput", "confidence": "medium",
                                           "evidence": []}),
            Record("event", 40, "knob_applied", {"change_id": "auto1", "requested_by": "autopilot",
                                                 "changes": {"async.max_staleness": {"old": 0, "new": 1}},
                                                 "reason": {**eta, "evidence": []}})])
        expect(page.locator("#event-log")).to_contain_text(
            "staleness: async.max_staleness 0 → 1 — eta holds generation back")
        expect(page.locator("#event-log")).to_contain_text(
            "autopilot: async.max_staleness 0 → 1 (staleness: eta holds generation back)")
        expect(page.locator('#advice-list li[data-key="0123456789ab"]')).to_contain_text("applied from step 41")
        page.screenshot(path=SHOTS.format("04-autopilot"), full_page=True)
        page.locator("#advice").screenshot(path=SHOTS.format("04b-panel"))

        # --- a watcher sees the advice, not the buttons
        watcher = prepare_page(page.context.browser.new_page(viewport={"width": 1500, "height": 1100}), errors,
                               timeout_ms=20_000)
        browser_login(watcher, live_asgi, "frank", "frank-pw-123")
        watcher.goto(f"{live_asgi}/runs/{run.pk}/")
        expect(watcher.locator('#advice-list li[data-rule="health"] .advice-move')).to_have_text(
            ["algo.kl_coef: 0.01 → 0.02"])
        expect(watcher.locator("#advice-list .advice-apply, #advice-list .advice-dismiss")).to_have_count(0)
        expect(watcher.locator('#autopilot-rules input[value="staleness"]')).to_be_disabled()

        # --- the report
        page.goto(f"{live_asgi}/runs/{run.pk}/report/")
        applied = page.locator("#advice-applied")
        expect(applied).to_contain_text("erin (from advice)")
        expect(applied).to_contain_text("trained tokens/s: 150 → 180 (+20%), 10 steps before and 10 after")
        expect(applied).to_contain_text("autopilot")
        expect(applied).to_contain_text("trained tokens/s: 180 over the 10 steps before; no step after it yet")
        expect(page.locator("#advice-dismissed")).to_contain_text(length["message"])
        page.locator("#advice-report").scroll_into_view_if_needed()
        page.locator("#advice-report").screenshot(path=SHOTS.format("05-report"))
    assert not errors, errors
