"""The live page's control buttons in headless Chromium follow the server's allowed actions
(webapp/dashboard/lifecycle.py), from the control replies and from the WebSocket frames a second
viewer receives: Resume is enabled while a pause is pending, as the server allows. The run is a
row without a worker; the trainer's `paused` event is written as the database sink writes it."""
import shutil

import pytest
from conftest import CHROMIUM

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.embedded_only]

BUTTONS = ("pause", "resume", "stop", "kill")


def enabled(page) -> dict[str, bool]:
    return {b: page.locator(f"#btn-{b}").is_enabled() for b in BUTTONS}


def test_the_buttons_follow_the_allowed_actions(live_asgi, django_user_model, make_run, monkeypatch):
    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing"
    from conftest import logged_in_page, prepare_page, wait_until
    from playwright.sync_api import expect

    from webapp.dashboard import actions
    from webapp.dashboard.actions import Record

    owner = django_user_model.objects.create_user("dave", password="dave-pw-123")
    run = make_run(owner, "running", name="buttons")
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")   # Playwright's loop runs in this thread
    with logged_in_page(live_asgi, "dave", "dave-pw-123") as (page, errors):
        watcher = prepare_page(page.context.new_page(), errors, timeout_ms=30_000)   # same session, a second tab
        for pg in (page, watcher):
            pg.goto(f"{live_asgi}/runs/{run.pk}/")
            expect(pg.locator("#conn")).to_have_text("live")

        def buttons_are(pg, **want):
            for b, on in want.items():
                (expect(pg.locator(f"#btn-{b}")).to_be_enabled if on
                 else expect(pg.locator(f"#btn-{b}")).to_be_disabled)()
            assert enabled(pg) == want, enabled(pg)

        buttons_are(page, pause=True, resume=False, stop=True, kill=True)
        # a pause the trainer has not reached yet: still running, and Resume takes it back
        page.click("#btn-pause")
        expect(page.locator("#action-msg")).to_have_text("pause requested")
        expect(page.locator("#run-status")).to_have_text("running")
        for pg in (page, watcher):   # the watcher learns it from the pause_requested frame
            buttons_are(pg, pause=False, resume=True, stop=True, kill=True)
        page.click("#btn-resume")
        expect(page.locator("#action-msg")).to_have_text("resume requested")
        for pg in (page, watcher):
            buttons_are(pg, pause=True, resume=False, stop=True, kill=True)
        assert wait_until(lambda: type(run).objects.get(pk=run.pk).desired == "run", 5, "desired run")

        # the trainer pauses at its step boundary: paused, Resume stays enabled
        page.click("#btn-pause")
        expect(page.locator("#action-msg")).to_have_text("pause requested")
        actions.append(run.pk, [Record("event", 1, "paused", {"requested_by": "web"})])
        for pg in (page, watcher):
            expect(pg.locator("#run-status")).to_have_text("paused")
            buttons_are(pg, pause=False, resume=True, stop=True, kill=True)
        # stopping: only kill is left, and no knob change is accepted
        watcher.click("#btn-stop")
        for pg in (page, watcher):
            expect(pg.locator("#run-status")).to_have_text("stopping")
            buttons_are(pg, pause=False, resume=False, stop=False, kill=True)
            expect(pg.locator("#knob-apply")).to_be_disabled()
    assert not errors, errors
