"""A multi-process run (cluster.train_procs = 2) launched from the launch form in headless
Chromium, on the session's real Celery worker: the worker starts torchrun, which runs
`manage.py train_rank` on two ranks (tasks.train_under_torchrun). The story:

    launch (the layout shown) -> a chart draws -> optim.lr changed (applied) -> pause -> resume
    -> stop (checkpoint; torchrun and its ranks end) -> resume from the checkpoint (a new
    torchrun) -> kill -> no process of the run left

The run's processes are found by their command lines (`train_rank <id>`: torchrun and its ranks)
and, while they run, by torchrun's descendants (the engine's children included, whatever the
mode starts); after the kill every one of them must be gone.
"""
from __future__ import annotations

import re
import shutil
import time

import psutil
import pytest
from conftest import CHROMIUM, logged_in_page, submit_launch_form
from test_web_e2e import DRAWN

from webapp.dashboard.models import KnobChange, MetricPoint, Run, RunEvent

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.embedded_only]

FORM = {"rollout.rollout_batch_size": "4", "rollout.n_samples_per_prompt": "4",
        "rollout.max_response_len": "48", "rollout.max_slots": "16", "run.eval_every": "0",
        "run.checkpoint_every": "2", "run.reward_workers": "0", "model.threads": "1",
        "run.max_steps": "3000"}
# (preset, its cluster fields, the layout the run page shows, whether the run starts engine
# processes (`python -m trainer.engine.process`) that the kill must end too)
CASES = [
    pytest.param("demo", {"cluster.train_procs": "2"}, "2 training processes", False, id="demo-2"),
    # every technique (async with its engine process, APRIL, GRESO, dynamic sampling)
    pytest.param("all", {"cluster.train_procs": "2", "cluster.gen_procs": "1", "april.segment_max_tokens": "32"},
                 "2 training processes + 1 generation process", True, id="all-2+1"),
]
ENGINE_CHILD = "trainer.engine.process"
NEW_LR = "3e-5"
REWARD_POINTS = "() => (document.querySelector('#chart-reward').calcdata || [[]])[0].length"
GONE_WITHIN_S = 60.0


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_processes(rid: int) -> list[psutil.Process]:
    """torchrun and its ranks for run `rid` (their command lines end `train_rank <rid> ...`)."""
    out = []
    for p in psutil.process_iter():
        try:
            cmd = p.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if "train_rank" in cmd and cmd[cmd.index("train_rank") + 1:][:1] == [str(rid)] and _alive(p):
            out.append(p)
    return out


def torchrun_and_ranks(rid: int) -> tuple[psutil.Process, list[psutil.Process], list[psutil.Process]]:
    """The run's torchrun, its two ranks and every descendant of torchrun (once both ranks run)."""
    def found():
        procs = run_processes(rid)
        launchers = [p for p in procs if "torch.distributed.run" in p.cmdline()]
        ranks = [p for p in procs if p not in launchers]
        return (launchers, ranks) if len(launchers) == 1 and len(ranks) == 2 else None
    deadline = time.monotonic() + 60
    while (got := found()) is None and time.monotonic() < deadline:
        time.sleep(0.3)
    procs = run_processes(rid)
    assert got, f"run {rid}: expected torchrun and 2 ranks, found {[p.cmdline() for p in procs]}"
    (launcher,), ranks = got
    assert {r.ppid() for r in ranks} == {launcher.pid}, "the ranks are not torchrun's children"
    return launcher, ranks, launcher.children(recursive=True)


def wait_gone(procs: list[psutil.Process], rid: int, what: str) -> None:
    deadline = time.monotonic() + GONE_WITHIN_S
    while time.monotonic() < deadline:
        left = [p for p in procs if _alive(p)] + [p for p in run_processes(rid) if p not in procs]
        if not left:
            return
        time.sleep(0.3)
    raise AssertionError(f"{what}: processes of run {rid} left after {GONE_WITHIN_S} s: "
                         + "; ".join(f"{p.pid} {' '.join(p.cmdline())}" for p in left if _alive(p)))


def _step(page) -> int:
    return int(page.locator("#run-step").inner_text() or 0)


def engine_children(tree: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in tree:
        try:
            if ENGINE_CHILD in " ".join(p.cmdline()):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


@pytest.mark.parametrize("preset,cluster,layout,engine_procs", CASES)
def test_a_multi_process_run_from_the_form(preset, cluster, layout, engine_procs, live_asgi, celery_worker,
                                           django_user_model, monkeypatch, tmp_path):
    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing (apt-get install -y chromium)"
    from playwright.sync_api import expect

    django_user_model.objects.create_user("mp", password="mp-pw-123")
    form = {**FORM, **cluster}
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")   # Playwright's loop in this thread
    with logged_in_page(live_asgi, "mp", "mp-pw-123", viewport={"width": 1400, "height": 1000},
                        dialogs="accept") as (page, errors):   # the kill's confirmation

        # launch: the cluster fields are in the form, with a note on what they start
        page.fill("#id_name", f"{preset} in several processes")
        page.select_option("#id_preset", preset)
        page.evaluate("document.querySelectorAll('details.section').forEach(d => d.open = true)")
        expect(page.locator("#note-cluster")).to_contain_text("torchrun")
        expect(page.locator("#f-cluster\\.gen_procs")).to_be_visible()
        rid = submit_launch_form(page, form)
        config = Run.objects.get(pk=rid).config["cluster"]
        asked = {k: v for k, v in cluster.items() if k.startswith("cluster.")}
        assert {f"cluster.{k}": str(v) for k, v in config.items() if f"cluster.{k}" in asked} == asked
        expect(page.locator("#run-layout")).to_have_text(layout)

        # watched: both ranks run under one torchrun, the reward chart draws
        expect(page.locator("#run-status")).to_have_text("running", timeout=60_000)
        launcher, ranks, _ = torchrun_and_ranks(rid)
        page.wait_for_function(f"() => ({REWARD_POINTS})() >= 2", timeout=120_000)
        reward = page.evaluate(DRAWN)["chart-reward"][0]
        assert reward["n"] >= 2 and reward["finite"] == reward["n"], reward
        assert MetricPoint.objects.filter(run_id=rid, key="dist/world_size", value=2).exists()

        # a knob: optim.lr, applied at a step boundary (rank 0 broadcasts it)
        page.evaluate("document.querySelectorAll('#knob-rows details').forEach(d => d.open = true)")
        page.fill('#knob-rows input[name="optim.lr"]', NEW_LR)
        page.click("#knob-apply")
        expect(page.locator("#knob-changes li").first).to_have_text(
            re.compile(r"applied from step \d+"), timeout=60_000)
        applied = KnobChange.objects.get(run_id=rid).applied_step
        assert applied and applied >= 1
        # the ranks step together with the new rate: a later step's actor/lr is it
        deadline = time.monotonic() + 60
        while not MetricPoint.objects.filter(run_id=rid, key="actor/lr", value=3e-5).exists():
            assert time.monotonic() < deadline, "no step trained with the new learning rate"
            time.sleep(0.3)

        tree = launcher.children(recursive=True)   # the engine's processes started by now
        assert bool(engine_children(tree)) == engine_procs, [p.cmdline() for p in tree]

        # pause holds every rank at a step boundary; resume goes on
        page.click("#btn-pause")
        expect(page.locator("#run-status")).to_have_text("paused", timeout=60_000)
        held = Run.objects.get(pk=rid).step
        assert all(_alive(p) for p in [launcher, *ranks]), "a process ended while paused"
        page.click("#btn-resume")
        expect(page.locator("#run-status")).to_have_text("running", timeout=60_000)
        page.wait_for_function(f"() => Number(document.querySelector('#run-step').textContent) > {held}",
                               timeout=60_000)

        # stop: the step ends, a checkpoint is written, torchrun and its ranks exit
        page.click("#btn-stop")
        expect(page.locator("#run-status")).to_have_text("stopped", timeout=90_000)
        stopped_at = _step(page)
        wait_gone([launcher, *tree], rid, "after stop")
        run = Run.objects.get(pk=rid)
        assert run.status == "stopped" and not run.error, run.error
        assert RunEvent.objects.filter(run_id=rid, kind="checkpoint", step=stopped_at).exists()

        # resume from the checkpoint: a new torchrun, the steps go on from there
        page.click("#btn-resume")
        expect(page.locator("#run-status")).to_have_text("running", timeout=60_000)
        launcher2, ranks2, _ = torchrun_and_ranks(rid)
        assert launcher2.pid != launcher.pid
        assert RunEvent.objects.filter(run_id=rid, kind="rewound", step=stopped_at).exists()
        page.wait_for_function(f"() => Number(document.querySelector('#run-step').textContent) >= "
                               f"{stopped_at + 2}", timeout=120_000)
        tree2 = launcher2.children(recursive=True)
        assert bool(engine_children(tree2)) == engine_procs, [p.cmdline() for p in tree2]
        assert Run.objects.get(pk=rid).knobs["optim.lr"] == pytest.approx(3e-5)   # kept on resume

        # kill: the worker child is SIGKILLed; torchrun, the ranks and their children end
        page.click("#btn-kill")
        expect(page.locator("#run-status")).to_have_text("stopped", timeout=30_000)
        wait_gone([launcher2, *tree2], rid, "after kill")
        expect(page.locator("#event-log")).to_contain_text("killed")
        page.screenshot(path=str(tmp_path / "killed.png"), full_page=True)
    assert not errors, errors
