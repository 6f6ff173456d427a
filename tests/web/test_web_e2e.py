"""End to end in headless Chromium (Debian's chromium driven by Playwright): log in, launch a
tiny run from the form, watch the charts update over the WebSocket, change a knob and see it
applied, stop the run."""
import os
import re
import shutil

import pytest

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def test_browser_flow(live_asgi, django_user_model, monkeypatch):
    assert shutil.which(CHROMIUM), (f"{CHROMIUM} is missing: `make test` installs it (apt-get install -y "
                                    "chromium) when run as root")
    from playwright.sync_api import expect, sync_playwright

    django_user_model.objects.create_user("erin", password="erin-pw-123")
    # Playwright's sync API runs an event loop in this thread; the ORM is not used below
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    errors = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("pageerror", lambda e: (errors.append(str(e)), print("page error:", e)))
            page.on("console", lambda m: print("console:", m.type, m.text))
            page.set_default_timeout(30_000)
            page.goto(live_asgi + "/")
            page.fill("#id_username", "erin")
            page.fill("#id_password", "erin-pw-123")
            page.click("#login-submit")
            page.wait_for_selector("#launch-form")

            # launch: a per-field error first, then a valid tiny run
            page.fill("#id_name", "e2e <i>run</i>")
            page.select_option("#id_preset", "demo")
            page.click("details.section:has(#f-optim\\.lr) > summary")   # open [optim]
            page.fill("#f-optim\\.lr", "5")
            page.click("#launch-submit")
            expect(page.locator('[data-error-for="optim.lr"]')).to_contain_text("expected a number")
            page.fill("#f-optim\\.lr", "")
            page.evaluate("document.querySelectorAll('details.section').forEach(d => d.open = true)")
            for key, value in {"rollout.rollout_batch_size": "4", "rollout.n_samples_per_prompt": "4",
                               "rollout.max_response_len": "64", "rollout.max_slots": "16",
                               "run.eval_every": "0", "run.checkpoint_every": "0",
                               "run.reward_workers": "0", "model.threads": "1",
                               "run.max_steps": "3000"}.items():
                page.fill("#f-" + key.replace(".", "\\."), value)
            page.click("#launch-submit")
            page.wait_for_url(re.compile(r"/runs/\d+/$"))
            expect(page.locator("#run-name")).to_have_text("e2e <i>run</i>")   # escaped, shown as text

            # charts update live, with no reload
            expect(page.locator("#conn")).to_have_text("live")
            expect(page.locator("#run-status")).to_have_text("running", timeout=30_000)
            reward = page.locator("#chart-reward")
            page.wait_for_function("() => +document.querySelector('#chart-reward').dataset.npoints >= 3")
            n1 = int(reward.get_attribute("data-npoints"))
            page.wait_for_function(f"() => +document.querySelector('#chart-reward').dataset.npoints > {n1}")
            expect(page.locator("#chart-len-heat")).not_to_have_class(re.compile("empty"))
            expect(page.locator("#chart-system")).to_contain_text("CPU")
            assert int(page.locator("#run-step").inner_text()) >= 1

            # change a knob: pending, then applied at step N, and an annotation on the charts
            page.fill('#knob-rows input[name="optim.lr"]', "3e-5")
            page.click("#knob-apply")
            change = page.locator("#knob-changes li").first
            expect(change).to_have_text(re.compile(r"applied at step \d+"), timeout=60_000)
            expect(page.locator('[data-current="optim.lr"]')).to_have_text(re.compile(r"^(3e-5|0\.00003)$"))
            expect(page.locator("#event-log")).to_contain_text("knob_applied")

            if os.environ.get("RLPILOT_E2E_SCREENSHOT"):
                page.wait_for_timeout(1500)
                page.screenshot(path=os.environ["RLPILOT_E2E_SCREENSHOT"], full_page=True)
            # stop
            page.click("#btn-stop")
            expect(page.locator("#run-status")).to_have_text("stopped", timeout=60_000)
            expect(page.locator("#event-log")).to_contain_text("run_stopped")
            expect(page.locator("#btn-resume")).to_be_enabled()

            # the report: the same charts, static, and the knob change in the timeline
            run_id = int(re.search(r"/runs/(\d+)/", page.url).group(1))
            page.click("#report-link")
            page.wait_for_selector("body[data-charts-drawn='1']")
            expect(page.locator("#chart-reward")).not_to_have_class(re.compile("empty"))
            expect(page.locator("#chart-len-heat")).not_to_have_class(re.compile("empty"))
            expect(page.locator("#knob-timeline")).to_contain_text("optim.lr")
            expect(page.locator("#run-name")).to_have_text("e2e <i>run</i>")

            # compare it with a second (empty) run: one chart per chosen metric, EMA smoothing
            from conftest import make_run

            other = make_run(django_user_model.objects.get(username="erin"), "finished", name="other")
            page.goto(f"{live_asgi}/compare/?ids={run_id},{other.pk}")
            page.wait_for_selector("body[data-charts-drawn='1']")
            chart = page.locator('[data-metric="reward/mean"]')
            expect(chart.locator(".main-svg").first).to_be_attached()
            assert int(chart.get_attribute("data-npoints")) >= 3
            page.fill("#ema", "0.9")
            page.dispatch_event("#ema", "input")
            expect(page.locator("#ema-value")).to_have_text("0.9")
            expect(page.locator("#config-diff")).to_contain_text("run.max_steps")
        finally:
            browser.close()
    assert not errors, errors
