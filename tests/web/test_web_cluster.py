"""Multi-process runs, the parts around the trainer: how many training processes a run may ask
for (at launch, and again by the worker on its own machine), and a run whose torchrun fails
before its rank 0 could report, or loses a rank mid-run: it ends `failed` naming the rank, how it
ended, the step and where a resume continues, with the ranks' last error lines.
The whole story in a browser is tests/web/test_web_multiprocess.py."""
import json
import re
import shutil

import pytest

from trainer import config as config_mod
from webapp.dashboard.access import validation
from webapp.dashboard.actions import run_dir
from webapp.dashboard.models import Run, Status
from webapp.dashboard.worker import tasks

pytestmark = [pytest.mark.django_db, pytest.mark.timeout(120)]


def launch(client, tiny, **overrides):
    return client.post("/api/runs", json.dumps({"name": "c", "preset": "demo", "overrides": {**tiny, **overrides}}),
                       content_type="application/json")


def queued_run(owner, tiny, **overrides) -> Run:
    cfg = config_mod.load("demo", {**tiny, **overrides})
    return Run.objects.create(owner=owner, name="c", config=cfg.to_dict(), knobs=cfg.knob_values(),
                              max_steps=cfg.run.max_steps, status=Status.QUEUED)


def test_the_launch_refuses_more_training_processes_than_the_setting(alice, tiny, settings):
    settings.RLPILOT_MAX_TRAIN_PROCS = 2
    r = launch(alice, tiny, **{"cluster.train_procs": 4})
    assert r.status_code == 400, r.content
    error = r.json()["errors"]["cluster.train_procs"]
    assert "at most 2 training processes" in error and "RLPILOT_MAX_TRAIN_PROCS" in error and "got 4" in error
    assert not Run.objects.exists()
    settings.RLPILOT_MAX_TRAIN_PROCS = 0   # default: only the worker knows its machine
    assert launch(alice, tiny, **{"cluster.train_procs": 4}).status_code == 201


def test_the_worker_refuses_more_than_its_machine_holds(user, tiny, settings, monkeypatch):
    settings.RLPILOT_MAX_TRAIN_PROCS = 0
    monkeypatch.setattr(validation.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(validation.os, "cpu_count", lambda: 2)
    run = queued_run(user, tiny, **{"cluster.train_procs": 3, "model.device": "cpu"})
    assert tasks.execute(Run.objects.get(pk=run.pk)) == Status.FAILED
    run.refresh_from_db()
    assert run.status == Status.FAILED and not run.started_at
    assert "refused by this worker's settings: cluster.train_procs: at most 2 training processes" in run.error
    assert "CPU count" in run.error, run.error


def test_a_failing_torchrun_fails_the_run_with_its_error(user, tiny, monkeypatch, tmp_path):
    """The ranks die before rank 0 could end the run (here: at start): the worker ends it."""
    script = tmp_path / "rank.py"
    script.write_text("raise SystemExit('rank cannot start: no such device cuda:7')\n")
    monkeypatch.setattr(tasks, "train_rank_argv", lambda rid, resume: [str(script)])
    run = queued_run(user, tiny, **{"cluster.train_procs": 2})
    assert tasks.execute(Run.objects.get(pk=run.pk)) == Status.FAILED
    run.refresh_from_db()
    assert run.status == Status.FAILED and run.started_at and run.finished_at
    assert re.match(r"training rank [01] exited with status 1 during step 1; no checkpoint was written: "
                    r"a resume starts over\n", run.error), run.error
    assert "rank cannot start: no such device cuda:7" in run.error, run.error


def test_a_training_rank_killed_mid_run_is_named_with_its_step_and_checkpoint(user, tiny, monkeypatch, tmp_path):
    """Rank 1 SIGKILLed while the run is at step 7 with a checkpoint at step 6: the run's error
    says so, not torchrun's banner (the same on a real run: tests/test_launch.py)."""
    script = tmp_path / "rank.py"
    script.write_text("import os, time\nif os.environ['RANK'] == '1':\n    os.kill(os.getpid(), 9)\n"
                      "time.sleep(120)\n")
    monkeypatch.setattr(tasks, "train_rank_argv", lambda rid, resume: [str(script)])
    run = queued_run(user, tiny, **{"cluster.train_procs": 2})
    ckpt = run_dir(run.pk) / "checkpoints" / "step_000006"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text("{}")
    monkeypatch.setattr(tasks.actions, "set_status", _running_at_step(7))
    try:
        assert tasks.execute(Run.objects.get(pk=run.pk)) == Status.FAILED
    finally:   # run ids are reused by the next tests: their folders must start empty
        shutil.rmtree(run_dir(run.pk), ignore_errors=True)
    run.refresh_from_db()
    assert run.error == ("training rank 1 was killed by SIGKILL (signal 9) during step 8; "
                         "resume continues from the checkpoint at step 6"), run.error


def _running_at_step(step: int):
    """actions.set_status, then the run at `step` (as rank 0's reports would have left it)."""
    from webapp.dashboard import actions

    real = actions.set_status

    def set_status(rid, status, **kw):
        done = real(rid, status, **kw)
        Run.objects.filter(pk=rid).update(step=step)
        return done
    return set_status


def test_the_pages_show_the_process_layout(alice, user, tiny, make_run):
    one = make_run(user, status="finished")
    several = make_run(user, status="finished")
    several.config["cluster"] = {"train_procs": 2, "gen_procs": 1}
    several.save(update_fields=["config"])
    for url in ("/runs/{}/", "/runs/{}/report/"):
        assert "2 training processes + 1 generation process" in alice.get(url.format(several.pk)).content.decode()
        page = alice.get(url.format(one.pk)).content.decode()
        assert "1 process" in page and "training processes" not in page
    form = alice.get("/").content.decode()
    assert 'id="f-cluster.train_procs"' in form and 'id="note-cluster"' in form


def test_too_many_generation_processes_are_refused_by_name(settings):
    settings.RLPILOT_MAX_GEN_PROCS = 2
    cfg = config_mod.load("all", ["cluster.gen_procs=3"])
    assert validation.config_problems(cfg)["cluster.gen_procs"] == (
        "at most 2 generation processes on this server (RLPILOT_MAX_GEN_PROCS); got 3")
    assert "cluster.gen_procs" not in validation.config_problems(config_mod.load("all", ["cluster.gen_procs=2"]))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.django_db(transaction=True)
def test_a_generation_process_that_keeps_dying_is_the_runs_error_as_the_cli_says_it(user, tiny, monkeypatch):
    """The real SIGKILL loop of tests/test_generation_lost.py on a dashboard run: its error is
    the sentence the CLI prints after "run failed: "."""
    from test_generation_lost import arm_kill_loop, sentence

    loop = arm_kill_loop(monkeypatch)
    run = queued_run(user, tiny, **{"cluster.gen_procs": 1, "run.max_steps": 4, "run.checkpoint_every": 1})
    try:
        assert tasks.execute(Run.objects.get(pk=run.pk)) == Status.FAILED
    finally:   # run ids are reused by the next tests: their folders must start empty
        shutil.rmtree(run_dir(run.pk), ignore_errors=True)
    run.refresh_from_db()
    assert run.error == sentence(loop.killed[-1], "resume continues from the checkpoint at step 1"), run.error
