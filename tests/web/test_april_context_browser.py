"""APRIL's rules of thumb on the live run page, in headless Chromium: beside the key knobs, the
over-sampling ratio, the segment limit against the response lengths so far and the buffer in
tokens against the write-up's sizing rule, as a person reads them, updated by a new step's metrics.
The line is the server's (webapp/dashboard/reports/advice.py april_context, from trainer/pilot/april.py's
figures): in the page, and in each read of the run the page makes when steps arrive."""
import shutil

import pytest

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.embedded_only]


def points(step: int, longest: float, buffer: float):
    from webapp.dashboard.actions import Record

    return Record("points", step, "", {"rollout/response_len/max": longest,
                                       "rollout/response_len/p90": 50.0, "rollout/response_len/mean": 20.0,
                                       "april/buffer_tokens": buffer})


def test_the_live_page_shows_aprils_rules_of_thumb_beside_the_runs_values(live_asgi,
                                                                          django_user_model,
                                                                          monkeypatch):
    from conftest import CHROMIUM, logged_in_page, make_run
    from playwright.sync_api import expect

    from webapp.dashboard import actions

    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing"
    owner = django_user_model.objects.create_user("april", password="april-pw-123")
    run = make_run(owner, "running")
    run.config["rollout"]["rollout_batch_size"] = 4
    run.config["april"].update(enabled=True, over_sampling_batch_size=8, segment_max_tokens=4)
    run.knobs.update({"april.enabled": True, "april.over_sampling_batch_size": 8,
                      "april.segment_max_tokens": 4})
    run.save(update_fields=["config", "knobs"])
    actions.append(run.pk, [points(1, 120.0, 300.0), points(2, 202.0, 313.0)], {"step": 2})

    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")   # Playwright's loop runs in this thread
    with logged_in_page(live_asgi, "april", "april-pw-123", timeout_ms=20_000) as (page, errors):
        page.goto(f"{live_asgi}/runs/{run.pk}/")
        expect(page.locator("#conn")).to_have_text("live")
        context = page.locator('[data-group="key"] #april-context')
        # N' 8 over a batch of 4; half of the longest response so far (202) is 101; the sizing rule:
        # 20 tokens x (8 - 4) groups x 4 samples
        expect(context).to_have_text(
            "APRIL's rules of thumb: N′ 8 is 2.0x the batch of 4 (1.5–2x) · segment limit 4 against "
            "responses of p90 50, longest 202 tokens (first at half the longest: 101, then from the "
            "idle slots) · buffer 313 tokens against the sizing rule's 320 (mean length 20 × 16 over-sampled "
            "samples ÷ the throughput gain, taken as 1)")
        # a new step, live: the page reads the run again (at most every 5 s) and shows the server's line
        actions.append(run.pk, [points(3, 250.0, 40.0)], {"step": 3})
        expect(context).to_contain_text("longest 250 tokens (first at half the longest: 125", timeout=40_000)
        expect(context).to_contain_text("buffer 40 tokens")
        assert not errors, errors
