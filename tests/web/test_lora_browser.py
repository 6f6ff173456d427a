"""LoRA in headless Chromium: the launch form's [lora] section refuses an empty
lora.target_modules by its field; a demo run with lora.rank = 8 launched from the form trains on
the session's Celery worker; its live page says what trains once the trainer reports it (the
run_started frame), its report says it too and downloads the adapter as a .zip.
Screenshots: RLPILOT_LORA_SCREENSHOT_DIR (default /tmp/lora_shots)."""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.embedded_only]

SHOTS = Path(os.environ.get("RLPILOT_LORA_SCREENSHOT_DIR", "/tmp/lora_shots"))
TRAINS = re.compile(r"^LoRA r=8, α=16: [\d,]+ trainable parameters of [\d,]+ \([\d.]+%\), adapter [\d.,]+ KiB$")


def shot(page, name, locator=None):
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    (locator or page).screenshot(path=path, **({} if locator else {"full_page": True}))
    print("screenshot:", path)


@pytest.mark.timeout(600)
def test_a_lora_run_from_the_form_to_its_adapter(live_asgi, django_user_model, monkeypatch, tiny):
    from conftest import CHROMIUM, logged_in_page, submit_launch_form
    from playwright.sync_api import expect

    from webapp.dashboard.models import Run

    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing"
    django_user_model.objects.create_user("lena", password="lena-pw-123")
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")   # Playwright's loop runs in this thread
    fields = {k: str(v) for k, v in tiny.items()}
    with logged_in_page(live_asgi, "lena", "lena-pw-123", viewport={"width": 1400, "height": 1000},
                        timeout_ms=30_000) as (page, errors):
        # --- the [lora] section: a bad value is refused by its field
        page.evaluate("document.querySelectorAll('details.section').forEach(d => d.open = true)")
        expect(page.locator("#f-lora\\.target_modules")).to_have_attribute("placeholder", "all-linear")
        page.fill("#id_name", "lora from the form")
        page.fill("#f-lora\\.rank", "8")
        page.fill("#f-lora\\.target_modules", ",")
        page.click("#launch-submit")
        error = page.locator('.field-error[data-error-for="lora.target_modules"]')
        expect(error).to_contain_text("name at least one module")
        section = page.locator("details.section", has=page.locator("#f-lora\\.rank"))
        expect(section).to_have_attribute("open", "")
        section.scroll_into_view_if_needed()
        shot(page, "01-form-lora-error", section)
        assert not Run.objects.exists()

        # --- launched: the live page says what trains once the trainer started
        page.evaluate("document.querySelectorAll('details.section').forEach(d => d.open = true)")
        page.fill("#f-lora\\.target_modules", "")
        rid = submit_launch_form(page, {**fields, "lora.rank": "8", "run.max_steps": "3"})
        run = Run.objects.get(pk=rid)
        assert run.config["lora"]["rank"] == 8 and run.config["lora"]["alpha"] == 16
        trains = page.locator("#run-trains")
        expect(trains).to_have_text(TRAINS, timeout=180_000)   # from the run_started frame
        expect(page.locator("#run-status")).to_have_text("finished", timeout=240_000)
        shot(page, "02-run-page")
        page.locator(".run-head").scroll_into_view_if_needed()
        shot(page, "03-run-head", page.locator(".run-head"))
        live_text = trains.inner_text()
        page.reload()
        expect(page.locator("#run-trains")).to_have_text(live_text)   # the server's line, the same

        # --- the report: the same line, and the adapter beside the exports
        page.goto(f"{live_asgi}/runs/{rid}/report/")
        expect(page.locator("#report-trains")).to_have_text(live_text)
        link = page.locator("#adapter-download")
        expect(link).to_have_text(re.compile(r"LoRA adapter \(\.zip, step 3\)"))
        shot(page, "04-report-head", page.locator(".run-head"))
        shot(page, "05-report")
        with page.expect_download() as info:
            link.click()
        download = info.value
        assert re.fullmatch(rf"rlpilot-run-{rid}-adapter-step-3\.zip", download.suggested_filename)
        z = zipfile.ZipFile(io.BytesIO(Path(download.path()).read_bytes()))
        folder = f"rlpilot-run-{rid}-adapter-step-3/"
        assert {folder + "adapter_config.json", folder + "adapter_model.safetensors"} <= set(z.namelist())
        assert json.loads(z.read(folder + "adapter_config.json"))["r"] == 8
    assert not errors, errors


@pytest.fixture(autouse=True)
def _no_run_left_behind(django_user_model):
    """A failure above leaves its run running on the session's worker: killed here."""
    yield
    from conftest import kill_active_runs

    kill_active_runs("lena")
