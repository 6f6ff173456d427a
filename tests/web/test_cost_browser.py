"""The cost in headless Chromium: a demo run launched from the form shows what it cost so far and
its forecast to max_steps on the live page while it trains, the line updates as steps arrive and
keeps only the cost so far once the run is stopped; the report's Cost card then holds the run's processes and figures.
Screenshots: RLPILOT_COST_SCREENSHOT_DIR (default /tmp/cost_shots)."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.embedded_only]

SHOTS = Path(os.environ.get("RLPILOT_COST_SCREENSHOT_DIR", "/tmp/cost_shots"))
ESTIMATE = re.compile(r"^Estimate: 5000 steps, about [\d.]+ (s|min|h) \([\d.]+ (s|min|h)–[\d.]+ (s|min|h)\) "
                      r"at [\d.]+ s a step; [\d.e-]+ cpu device-hours\. From (a calibration: \d+ steps of the run "
                      r"itself in 8 s|\d+ past runs? of the same shape: .+)\.$")
SO_FAR = r"So far: [\d.e-]+ cpu device-hours; idle \d+%(; [\d.]+% of it spent on tokens later dropped)?\."
TO_GO = re.compile(r"^" + SO_FAR + r" To go: (\d+) steps, about [\d.]+ (s|min|h) \([\d.]+ (s|min|h)–[\d.]+ (s|min|h)\) "
                   r"at [\d.]+ s a step over the last \d+\.$")


def shot(locator, name):
    SHOTS.mkdir(parents=True, exist_ok=True)
    locator.screenshot(path=SHOTS / f"{name}.png")
    print("screenshot:", SHOTS / f"{name}.png")


@pytest.mark.timeout(600)
def test_the_forecast_updates_while_a_run_trains_and_the_report_holds_its_cost(
        live_asgi, django_user_model, monkeypatch, tiny):
    from conftest import CHROMIUM, fill_launch_fields, logged_in_page, submit_launch_form
    from playwright.sync_api import expect

    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing"
    django_user_model.objects.create_user("cora", password="cora-pw-123")
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")   # Playwright's loop runs in this thread
    fields = {k: str(v) for k, v in tiny.items()}
    with logged_in_page(live_asgi, "cora", "cora-pw-123", viewport={"width": 1400, "height": 1000},
                        timeout_ms=30_000) as (page, errors):
        page.fill("#id_name", "cost from the form")
        page.evaluate("document.querySelectorAll('details.section').forEach(d => d.open = true)")
        # the estimate before the launch: a calibration on the worker, or a recorded run of this shape
        fill_launch_fields(page, {**fields, "run.max_steps": "5000"})
        estimate = page.locator("#launch-estimate")
        page.click("#estimate-submit")
        expect(estimate).to_have_text(ESTIMATE, timeout=120_000)
        box = page.locator("#launch-form").bounding_box()   # the form's head: the buttons and the estimate
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=SHOTS / "00-launch-estimate.png", clip={**box, "height": 160})
        rid = submit_launch_form(page, {**fields, "run.max_steps": "5000"})
        line = page.locator("#run-forecast")
        expect(line).to_have_text(TO_GO, timeout=180_000)
        first = int(re.search(r"To go: (\d+)", line.inner_text()).group(1))
        shot(page.locator(".run-head"), "01-run-forecast")
        # the line follows the steps: fewer to go a few steps later
        page.wait_for_function("n => { const m = /To go: (\\d+) steps/.exec("
                               "document.getElementById('run-forecast').textContent);"
                               " return m && +m[1] <= n - 3; }", arg=first, timeout=120_000)
        page.click("#btn-stop")
        expect(page.locator("#run-status")).to_have_text("stopped", timeout=120_000)
        expect(line).to_have_text(re.compile("^" + SO_FAR + "$"), timeout=30_000)   # nothing left to forecast
        shot(page.locator(".run-head"), "01b-run-cost-so-far")

        # the same form again: the stopped run is this shape's history now, and is named
        page.goto(f"{live_asgi}/")
        page.evaluate("document.querySelectorAll('details.section').forEach(d => d.open = true)")
        fill_launch_fields(page, {**fields, "run.max_steps": "5000"})
        page.click("#estimate-submit")
        expect(page.locator("#launch-estimate")).to_contain_text(f"#{rid} cost from the form", timeout=30_000)
        expect(page.locator("#launch-estimate")).to_have_text(ESTIMATE)

        page.goto(f"{live_asgi}/runs/{rid}/report/")
        card = page.locator("#cost")
        expect(card.locator("#cost-total")).to_contain_text("cpu device-hours")
        expect(card.locator('#cost-lanes tr[data-lane="rank 0"]')).to_contain_text("training")
        expect(card.locator('#cost-figures tr[data-key="per_trained_token"]')).to_contain_text("device-s")
        card.scroll_into_view_if_needed()
        shot(card, "02-report-cost")
    assert not errors, errors


@pytest.fixture(autouse=True)
def _no_run_left_behind(django_user_model):
    """A failure above leaves its run running on the session's worker: killed here."""
    yield
    from conftest import kill_active_runs

    kill_active_runs("cora")


@pytest.mark.timeout(300)
def test_the_comparison_draws_accuracy_against_cost(live_asgi, django_user_model, monkeypatch, make_run, settings):
    from conftest import CHROMIUM, logged_in_page
    from playwright.sync_api import expect
    from test_cost_report import recorded

    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing"
    cora = django_user_model.objects.create_user("cora", password="cora-pw-123")
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    cheap, dear = recorded(make_run, cora), recorded(make_run, cora)   # the same account twice ...
    dear.knobs = {**dear.knobs, "cost.cpu_core_hour": 0.72}            # ... one at twice the rate
    dear.save()
    cheap.knobs = {**cheap.knobs, "cost.cpu_core_hour": 0.36}
    cheap.save()
    lone = make_run(cora, "finished", name="no account")
    with logged_in_page(live_asgi, "cora", "cora-pw-123", viewport={"width": 1400, "height": 1000},
                        timeout_ms=30_000) as (page, errors):
        page.goto(f"{live_asgi}/compare/?ids={cheap.pk},{dear.pk},{lone.pk}")
        chart = page.locator("#compare-cost")
        expect(chart).to_have_attribute("data-npoints", "2")
        expect(chart.locator(".scatterlayer .points path")).to_have_count(2)   # what Plotly drew
        expect(chart.locator(".xtitle")).to_have_text("price")
        expect(chart.locator(".ytitle")).to_have_text("best held-out accuracy")
        note = page.locator("#compare-cost-note")
        expect(note).to_have_text("1 run without a cost account or an accuracy left out. ")
        labels = chart.locator(".scatterlayer .textpoint text").all_text_contents()
        assert sorted(labels) == sorted([f"#{cheap.pk} r", f"#{dear.pk} r"]), labels
        page.locator("#compare-cost-card").scroll_into_view_if_needed()
        shot(page.locator("#compare-cost-card"), "03-compare-cost")
        xs = page.evaluate("document.getElementById('compare-cost').data[0].x")
        assert xs[1] == pytest.approx(2 * xs[0])   # the dear run twice as far out
        # one of them without a rate: device-hours for both, where they are the same
        settings.RLPILOT_RATE_CPU_CORE_HOUR = 0.0
        cheap.knobs = {**cheap.knobs, "cost.cpu_core_hour": 0.0}
        cheap.save()
        page.goto(f"{live_asgi}/compare/?ids={cheap.pk},{dear.pk}")
        expect(chart.locator(".xtitle")).to_have_text("device-hours (GPU-hours + CPU core-hours)")
        expect(page.locator("#compare-cost-note")).to_have_text("Device-hours: not every run has a rate. ")
        xs = page.evaluate("document.getElementById('compare-cost').data[0].x")
        assert xs[0] == xs[1] == pytest.approx(30 / 3600)
    assert not errors, errors
