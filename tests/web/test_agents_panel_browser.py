"""Agents and your own environment on the dashboard, in headless Chromium.

1. The run page of an `episode.agents` run: its owner sees the endpoint's address (from the
   run_started event, updated live by a resume's) and their own API token behind "show my
   token"; staff see the panel with whose token it takes, not the token; another user sees no
   panel; the panel goes when the run ends, live and after a reload.
2. The launch form offers episode.environment and episode.agents; a path that does not import is
   refused next to its field, by name, and no run is made.
Screenshots: RLPILOT_AGENTS_SCREENSHOT_DIR (default /tmp/agents_shots)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from conftest import CHROMIUM

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.embedded_only]

SHOTS = Path(os.environ.get("RLPILOT_AGENTS_SCREENSHOT_DIR", "/tmp/agents_shots"))
URL, RESUMED_URL = "http://127.0.0.1:40123/v1", "http://127.0.0.1:40999/v1"


def shot(page, name, locator=None):
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    (locator or page).screenshot(path=path, **({} if locator else {"full_page": True}))
    print("screenshot:", path)


def test_the_run_page_tells_the_owner_where_their_agents_call(live_asgi, django_user_model, make_run,
                                                              monkeypatch):
    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing"
    from conftest import browser_login, logged_in_page, prepare_page
    from playwright.sync_api import expect

    from webapp.dashboard import actions
    from webapp.dashboard.models import ApiToken

    owner = django_user_model.objects.create_user("ava", password="ava-pw-123")
    django_user_model.objects.create_user("ben", password="ben-pw-123")
    django_user_model.objects.create_user("sam", password="sam-pw-123", is_staff=True)
    mine = ApiToken.objects.create(user=owner).key
    theirs = ApiToken.objects.create(user=django_user_model.objects.get(username="ben")).key
    run = make_run(owner, "running", name="agents")
    run.config["episode"]["agents"] = True
    run.save(update_fields=["config"])
    plain = make_run(owner, "running", name="plain")   # no endpoint: no panel
    actions.event(run.pk, 0, "run_started", {"max_steps": run.max_steps, "agents_url": URL})
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")   # Playwright's loop runs in this thread

    with logged_in_page(live_asgi, "ava", "ava-pw-123", viewport={"width": 1300, "height": 900}) as (page, errors):
        page.goto(f"{live_asgi}/runs/{run.pk}/")
        expect(page.locator("#conn")).to_have_text("live")
        panel = page.locator("#agents-panel")
        expect(panel).to_be_visible()
        expect(page.locator("#agents-url")).to_have_text(URL)
        expect(page.locator("#agents-auth")).to_contain_text("your API token")
        expect(page.locator("#agents-token")).to_be_hidden()   # not on screen until asked for
        panel.get_by_text("show my token").click()
        expect(page.locator("#agents-token")).to_have_text(mine)
        assert theirs not in page.content()
        shot(page, "01-run-page-owner")
        shot(page, "02-agents-panel", page.locator("section.run-head"))
        # a resume serves on another port: the panel follows the run_resumed frame
        actions.event(run.pk, 1, "run_resumed", {"max_steps": run.max_steps, "agents_url": RESUMED_URL})
        expect(page.locator("#agents-url")).to_have_text(RESUMED_URL)

        page.goto(f"{live_asgi}/runs/{plain.pk}/")
        expect(page.locator("#conn")).to_have_text("live")
        assert page.locator("#agents-panel").count() == 0

        for name in ("ben", "sam"):   # another user: no panel; staff: the panel, not the token
            session = page.context.browser.new_context()   # a session of their own
            other = prepare_page(session.new_page(), errors, timeout_ms=30_000)
            browser_login(other, live_asgi, name, f"{name}-pw-123")
            other.goto(f"{live_asgi}/runs/{run.pk}/")
            expect(other.locator("#conn")).to_have_text("live")
            html = other.content()
            assert mine not in html and theirs not in html
            if name == "ben":
                assert other.locator("#agents-panel").count() == 0
                assert other.locator("#run-status").inner_text() == "running"   # the page did render
            else:
                expect(other.locator("#agents-url")).to_have_text(RESUMED_URL)
                expect(other.locator("#agents-auth")).to_contain_text("API token of its owner, ava")
                assert other.locator("#agents-token").count() == 0
                shot(other, "03-run-page-staff", other.locator("section.run-head"))
            session.close()

        # the run ends: the endpoint with it, and the panel
        page.goto(f"{live_asgi}/runs/{run.pk}/")
        expect(page.locator("#conn")).to_have_text("live")
        expect(panel).to_be_visible()
        actions.set_status(run, "finished")
        expect(page.locator("#run-status")).to_have_text("finished")
        expect(panel).to_be_hidden()
        page.reload()
        expect(page.locator("#run-status")).to_have_text("finished")
        expect(panel).to_be_hidden()
    assert not errors, errors


def test_the_form_offers_the_environment_and_refuses_a_bad_path_by_its_field(live_asgi, django_user_model,
                                                                             monkeypatch):
    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing"
    from conftest import logged_in_page
    from playwright.sync_api import expect

    from webapp.dashboard.models import Run

    django_user_model.objects.create_user("eve", password="eve-pw-123")
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")   # Playwright's loop runs in this thread
    with logged_in_page(live_asgi, "eve", "eve-pw-123", viewport={"width": 1300, "height": 900}) as (page, errors):
        section = page.locator("details.section", has=page.locator("#f-episode\\.environment"))
        section.locator("summary").click()
        agents = page.locator("#f-episode\\.agents")
        expect(agents).to_be_visible()
        assert agents.locator("option").all_inner_texts()[1:] == ["true", "false"]
        page.fill("#id_name", "my env")
        page.fill("#f-episode\\.max_turns", "3")
        page.fill("#f-episode\\.environment", "fakes.no_such_module:GuessEnv")
        page.click("#launch-submit")
        field = page.locator(".field", has=page.locator("#f-episode\\.environment"))
        expect(field.locator('.field-error[data-error-for="episode.environment"]')).to_contain_text(
            "cannot import 'fakes.no_such_module'")
        expect(page.locator("#f-episode\\.environment")).to_have_value("fakes.no_such_module:GuessEnv")
        expect(section).to_have_attribute("open", "")   # the section with the error opens by itself
        field.scroll_into_view_if_needed()
        shot(page, "04-form-environment-error", section)
        assert not Run.objects.exists()
    assert not errors, errors
