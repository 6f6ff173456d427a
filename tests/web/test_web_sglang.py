"""The dashboard against a REAL SGLang server (the one `make sglang` installs in .venv-sglang)
serving SmolLM2-135M-Instruct: in headless Chromium, launch a tiny run with the `sglang` engine
from the launch form, watch Plotly draw its steps live, change `optim.lr` in the tuning panel and
see it applied, stop it, resume it from its checkpoint on the report page and see it finish.

The web side may use only the servers in RLPILOT_SGLANG_URLS and models inside
RLPILOT_MODEL_ROOTS, and the worker checks both again with its own settings: so this module
starts its own Celery worker and daphne with both set (on a queue of their own, away from the
session's worker), next to the session's SGLang server (real_sglang_server in tests/conftest.py,
OMP_NUM_THREADS=1, shared with tests/test_sglang_real.py; the run's weight updates are undone
after the test). Skipped only when .venv-sglang (`make sglang`) or the model directory
(`make sglang-model`) is absent.
"""
import os
import re
import shutil
import socket

import pytest
from conftest import _TMP, CHROMIUM, Proc, _test_db_env, logged_in_page, submit_launch_form
from test_web_e2e import DRAWN

from trainer.engine.sglang.server import ROOT, VENV
from trainer.models import gguf_import

MODEL_DIR = ROOT / "var" / "models" / gguf_import.SMOLLM2_DIR_NAME

pytestmark = [
    pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.embedded_only,
    pytest.mark.skipif(not (VENV / "bin" / "python").is_file(),
                       reason=f"no SGLang virtualenv at {VENV}: run `make sglang`"),
    pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(),
                       reason=f"no SmolLM2 model at {MODEL_DIR}: run `make sglang-model`"),
]

MAX_STEPS = 8
# the opt-in preset smollm2-math shrunk to a few seconds a step on one core
FORM = {"rollout.rollout_batch_size": "2", "rollout.n_samples_per_prompt": "2",
        "rollout.max_response_len": "24", "rollout.max_slots": "8", "model.threads": "1",
        "run.eval_every": "0", "run.checkpoint_every": "0", "run.reward_workers": "0",
        "run.max_steps": str(MAX_STEPS)}
NEW_LR = "2e-5"   # the preset's is 1e-5
REWARD_POINTS = "() => (document.querySelector('#chart-reward').calcdata || [[]])[0].length"


@pytest.fixture(scope="module")
def sglang_server(real_sglang_server):
    """The session's float32 server (tests/conftest.py: one OMP thread, stopped when the session
    ends with no process of its group left), shared with tests/test_sglang_real.py."""
    assert real_sglang_server.model_path.resolve() == MODEL_DIR.resolve()   # the form names it
    return real_sglang_server


@pytest.fixture(scope="module")
def sglang_site(django_db_setup, sglang_server):
    """A Celery worker and daphne, both allowed that server and the model's folder; yields the
    site's base URL."""
    from django.conf import settings

    from webapp.dashboard.management.commands.serve import server_command, worker_command

    queue = settings.TRAINING_QUEUE + "-sglang"
    env = _test_db_env()
    env.update(RLPILOT_SGLANG_URLS=sglang_server.url, RLPILOT_TRAINING_QUEUE=queue,
               RLPILOT_QUEUES=queue,
               RLPILOT_MODEL_ROOTS=f"{MODEL_DIR.resolve().parent},{settings.RUNS_DIR}")
    procs = []
    try:
        worker = Proc("celery worker (sglang)", worker_command(concurrency=1, queues=[queue],
                                                                name=f"sglang-{os.getpid()}"),
                      env, _TMP / "worker-sglang.log")
        procs.append(worker)
        port = _free_port()
        daphne = Proc("daphne (sglang)", server_command("127.0.0.1", port), env, _TMP / "daphne-sglang.log")
        procs.append(daphne)
        worker.wait_for(lambda: " ready." in worker.text(), 90, "'ready' line")
        daphne.wait_for(lambda: _listening(port), 60, "listening port")
        yield f"http://127.0.0.1:{port}"
    finally:
        for p in procs:
            p.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _step(page) -> int:
    return int(page.locator("#run-step").inner_text() or 0)


def test_a_run_on_a_real_sglang_server_from_the_browser(sglang_server, sglang_site,
                                                         django_user_model, monkeypatch,
                                                         sglang_original_weights_after):
    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing (apt-get install -y chromium)"
    from playwright.sync_api import expect

    from webapp.dashboard.models import Run

    django_user_model.objects.create_user("sgl", password="sgl-pw-123")
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")   # Playwright's loop in this thread
    with logged_in_page(sglang_site, "sgl", "sgl-pw-123",
                        viewport={"width": 1400, "height": 1000}) as (page, errors):

        # launch: the sglang engine (offered: the site lists the server), its URL, the model
        page.fill("#id_name", "sglang run")
        page.select_option("#id_preset", "smollm2-math")
        page.evaluate("document.querySelectorAll('details.section').forEach(d => d.open = true)")
        page.select_option("#f-rollout\\.engine", "sglang")
        page.fill("#f-rollout\\.sglang_urls", sglang_server.url)
        page.fill("#f-model\\.path", str(MODEL_DIR))
        run = Run.objects.get(pk=submit_launch_form(page, FORM))
        assert run.config["rollout"]["engine"] == "sglang"
        assert run.config["rollout"]["sglang_urls"] == sglang_server.url
        assert run.config["model"]["path"] == str(MODEL_DIR)

        # live: Plotly draws the steps as they arrive
        expect(page.locator("#run-status")).to_have_text("running", timeout=120_000)
        page.wait_for_function(f"() => ({REWARD_POINTS})() >= 2", timeout=180_000)
        drawn = page.evaluate(DRAWN)
        reward = drawn["chart-reward"][0]
        assert reward["n"] >= 2 and reward["finite"] == reward["n"], reward

        # tune: optim.lr, applied at a step boundary
        page.evaluate("document.querySelectorAll('#knob-rows details').forEach(d => d.open = true)")
        page.fill('#knob-rows input[name="optim.lr"]', NEW_LR)
        page.click("#knob-apply")
        expect(page.locator("#knob-changes li").first).to_have_text(
            re.compile(r"applied from step \d+"), timeout=120_000)
        expect(page.locator('[data-current="optim.lr"]')).to_have_text(re.compile(r"^(2e-5|0\.00002)$"))
        expect(page.locator("#event-log")).to_contain_text("knob_applied")

        # stop: the step ends, a checkpoint is written, the run is stopped short of the end
        page.click("#btn-stop")
        expect(page.locator("#run-status")).to_have_text("stopped", timeout=120_000)
        stopped_at = _step(page)
        print(f"stopped at step {stopped_at} of {MAX_STEPS}")
        assert 1 <= stopped_at < MAX_STEPS, \
            f"stopped at step {stopped_at} of {MAX_STEPS}: the resume below would prove nothing"
        expect(page.locator("#event-log")).to_contain_text("run_stopped")

        # resume from the report's checkpoint: it goes on to its last step and finishes
        page.click("#report-link")
        resume = page.locator(f'#checkpoints tr[data-step="{stopped_at}"] button.resume-from')
        expect(resume).to_be_visible()
        resume.click()
        page.wait_for_url(re.compile(r"/runs/\d+/$"))
        expect(page.locator("#run-status")).to_have_text("finished", timeout=240_000)
        assert _step(page) == MAX_STEPS
        page.wait_for_function(f"() => ({REWARD_POINTS})() >= {MAX_STEPS}", timeout=30_000)
        reward = page.evaluate(DRAWN)["chart-reward"][0]
        assert reward["n"] == MAX_STEPS and reward["last"] == MAX_STEPS, reward
        expect(page.locator("#event-log")).to_contain_text("run_finished")
    run.refresh_from_db()
    assert run.status == "finished" and run.step == MAX_STEPS, run.error
    assert run.knobs["optim.lr"] == pytest.approx(2e-5)   # the change survived the resume
    assert not errors, errors
    # the server kept serving through the whole story
    assert sglang_server.running and sglang_server.healthy()
