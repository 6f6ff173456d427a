"""The `stalled` alert: no step finished for max(ALERT_STALL_FACTOR x median step time,
ALERT_STALL_MIN_S) while running. Evaluated by the worker's heartbeat thread (alerts.StallWatch),
so a trainer that writes nothing at all is still seen. Hand-made rows with known step times and
a hand-driven clock, then the real Heartbeat thread."""
import pytest
from helpers import NoBell

from webapp.dashboard.models import Run, RunEvent
from webapp.dashboard.worker.alerts import Monitor, StallWatch
from webapp.dashboard.worker.telemetry import DbSink, Heartbeat

pytestmark = pytest.mark.django_db(transaction=True)



class Trainer:
    """Writes steps through the database sink's write path (synchronously, no writer thread)."""

    def __init__(self, run):
        self.run = run
        self.sink = DbSink(run.pk, doorbell=NoBell())
        self.step = 0

    def steps(self, *step_times):
        for t in step_times:
            self.step += 1
            self.write(self.step, {"timing/step_s": t, "reward/mean": 0.5, "actor/kl": 0.01})

    def write(self, step, values):
        self.sink.scalars(step, values)
        with self.sink.lock:
            records, self.sink.buffer = self.sink.buffer, []
        self.sink._write(records)


def alert_events(run):
    return [(e.step, e.kind, e.data.get("rule")) for e in
            RunEvent.objects.filter(run=run, kind__in=("alert", "alert_cleared")).order_by("seq")]


def active(run):
    return (Run.objects.get(pk=run.pk).alerts or {}).get("active") or {}


@pytest.fixture
def stall_settings(settings):
    settings.ALERT_STALL_FACTOR = 5
    settings.ALERT_STALL_MIN_S = 60
    return settings


def test_stalled_after_factor_times_the_median_then_cleared_by_the_next_step(user, make_run, stall_settings):
    run = make_run(user, "running")
    trainer = Trainer(run)
    trainer.steps(18, 20, 22, 19, 21, 20, 250)         # median 20 s (one slow step does not move it)
    watch = StallWatch(run.pk)
    assert watch.tick(now=0) == []                     # the first look: the step it starts from
    trainer.steps(20)                                  # step 8 finishes at t = 5
    assert watch.tick(now=5) == []
    assert watch.tick(now=5 + 99) == []                # 99 s < 5 x 20 s
    (rec,) = watch.tick(now=5 + 101)
    assert (rec.name, rec.values["rule"], rec.step) == ("alert", "stalled", 8)
    ev = RunEvent.objects.get(run=run, kind="alert")
    assert ev.data["stalled_s"] == 101 and ev.data["median_step_s"] == 20 and ev.data["limit_s"] == 100
    msg = ev.data["message"]
    assert "no step finished for 101 s" in msg and "median step time 20 s" in msg and "100 s" in msg
    assert active(run)["stalled"]["message"] == msg    # the banner state
    # raised once
    assert watch.tick(now=5 + 200) == [] and watch.tick(now=5 + 300) == []
    assert alert_events(run) == [(8, "alert", "stalled")]
    # the page shows the banner
    from django.test import Client

    c = Client()
    c.force_login(user)
    html = c.get(f"/runs/{run.pk}/").content.decode()
    assert 'data-rule="stalled"' in html and "no step finished for 101 s" in html

    trainer.steps(20)                                  # steps resume
    (rec,) = watch.tick(now=5 + 310)
    assert rec.name == "alert_cleared" and rec.values["rule"] == "stalled"
    assert alert_events(run) == [(8, "alert", "stalled"), (9, "alert_cleared", "stalled")]
    assert "stalled" not in active(run)
    # ... and may raise again after it cleared
    assert watch.tick(now=5 + 310 + 101)[0].name == "alert"
    assert [k for _, k, _ in alert_events(run)] == ["alert", "alert_cleared", "alert"]


def test_the_floor_keeps_fast_runs_from_false_alarms(user, make_run, stall_settings):
    run = make_run(user, "running")
    trainer = Trainer(run)
    trainer.steps(*[0.5] * 10)                          # 5 x 0.5 s = 2.5 s: the 60 s floor applies
    watch = StallWatch(run.pk)
    watch.tick(now=0)
    trainer.steps(0.5)
    watch.tick(now=1)
    assert watch.tick(now=1 + 30) == [] and watch.tick(now=1 + 60) == []
    (rec,) = watch.tick(now=1 + 61)
    assert "no step finished for 61 s" in rec.values["message"]
    assert "median step time 0.5 s" in rec.values["message"]
    assert rec.values["limit_s"] == 60


def test_nothing_before_a_step_finishes_in_this_attempt(user, make_run, stall_settings):
    """Loading the model and the first step after a (re)start never count."""
    run = make_run(user, "running")
    Trainer(run).steps(1, 1, 1)
    watch = StallWatch(run.pk)
    for t in (0, 100, 1000, 10000):
        assert watch.tick(now=t) == []
    assert alert_events(run) == []


def test_a_paused_run_is_not_stalled(user, make_run, stall_settings):
    run = make_run(user, "running")
    trainer = Trainer(run)
    trainer.steps(2, 2, 2)
    watch = StallWatch(run.pk)
    watch.tick(now=0)
    trainer.steps(2)
    watch.tick(now=1)
    Run.objects.filter(pk=run.pk).update(status="paused")
    for t in (100, 1000, 5000):
        assert watch.tick(now=t) == []
    # resumed: the paused hour is no stall; the clock runs again from the resume
    Run.objects.filter(pk=run.pk).update(status="running")
    assert watch.tick(now=5000 + 59) == []
    assert watch.tick(now=5000 + 62)[0].name == "alert"
    # a pause that lands clears it (the trainer reached a step boundary)
    Run.objects.filter(pk=run.pk).update(status="paused")
    assert watch.tick(now=5000 + 70)[0].name == "alert_cleared"
    assert "stalled" not in active(run)
    # other non-running states do not raise either
    Run.objects.filter(pk=run.pk).update(status="stopping")
    assert watch.tick(now=10 ** 6) == []


def test_the_sink_neither_drops_nor_resurrects_the_banner(user, make_run, stall_settings):
    run = make_run(user, "running")
    trainer = Trainer(run)
    trainer.steps(10, 10, 10)
    watch = StallWatch(run.pk)
    watch.tick(now=0)
    trainer.steps(10)
    watch.tick(now=0)
    assert watch.tick(now=61)[0].name == "alert"
    # an evaluation finishes at the same step: the sink's Monitor writes the alert state without
    # `stalled` (it does not own the rule); the next heartbeat tick puts the banner back, silently
    trainer.write(trainer.step, {"eval/accuracy": 0.5})
    assert "stalled" not in active(run)
    assert watch.tick(now=70) == []
    assert "stalled" in active(run)
    assert alert_events(run) == [(4, "alert", "stalled")]
    # cleared; later sink writes do not bring it back
    trainer.steps(10)
    assert watch.tick(now=71)[0].name == "alert_cleared"
    trainer.steps(10, 10)
    assert "stalled" not in active(run)
    assert Monitor({"active": {"stalled": {"message": "x"}, "kl_high": {"message": "y"}}}).active == {
        "kl_high": {"message": "y"}}


def test_a_resumed_run_clears_the_alert_of_its_last_attempt(user, make_run, stall_settings):
    run = make_run(user, "running", alerts={"active": {"stalled": {"message": "stalled: ...", "step": 3}},
                                            "state": {}})
    trainer = Trainer(run)
    trainer.step = 3
    watch = StallWatch(run.pk)                         # the new worker's heartbeat
    watch.tick(now=0)
    trainer.steps(5)
    (rec,) = watch.tick(now=8)
    assert rec.name == "alert_cleared" and "stalled" not in active(run)


def test_without_step_timings_the_pace_seen_is_the_median(user, make_run, stall_settings):
    run = make_run(user, "running")
    trainer = Trainer(run)
    watch = StallWatch(run.pk)
    watch.tick(now=0)
    for i in range(1, 4):                              # one step every 30 s, no timing/step_s
        trainer.step += 1
        trainer.write(trainer.step, {"reward/mean": 0.5})
        watch.tick(now=30 * i)
    assert watch.tick(now=90 + 149) == []              # 5 x 30 s
    rec = watch.tick(now=90 + 151)[0]
    assert "median step time 30 s" in rec.values["message"]


def test_the_heartbeat_thread_raises_it_while_the_trainer_writes_nothing(user, make_run, settings,
                                                                         wait_until):
    settings.ALERT_STALL_FACTOR = 5
    settings.ALERT_STALL_MIN_S = 0.5
    run = make_run(user, "running")
    trainer = Trainer(run)
    trainer.steps(0.05, 0.05, 0.05)
    beat = Heartbeat(run.pk, interval=0.1).start()
    try:
        wait_until(lambda: beat.stall.step == 3, 5, "the heartbeat's first look")
        trainer.steps(0.05)
        # ... and then the trainer is stuck: nothing is written, the heartbeat thread sees it
        wait_until(lambda: RunEvent.objects.filter(run=run, kind="alert", data__rule="stalled").exists(),
                   10, "the stalled alert")
        ev = RunEvent.objects.get(run=run, kind="alert")
        assert ev.step == 4 and ev.data["median_step_s"] == 0.05 and ev.data["stalled_s"] >= 0.5
        assert "stalled" in active(run)
        trainer.steps(0.05)
        wait_until(lambda: RunEvent.objects.filter(run=run, kind="alert_cleared").exists(), 10,
                   "the alert cleared")
        assert "stalled" not in active(run)
    finally:
        beat.stop()
    assert alert_events(run) == [(4, "alert", "stalled"), (5, "alert_cleared", "stalled")]


def test_an_evaluation_between_steps_is_no_stall_up_to_its_allowance(user, make_run, stall_settings):
    stall_settings.ALERT_STALL_PHASE_MAX_S = 300
    run = make_run(user, "running")
    trainer = Trainer(run)
    trainer.steps(18, 20, 22, 19, 21, 20)              # median 20 s: the limit is 100 s
    watch = StallWatch(run.pk)
    watch.tick(now=0)
    trainer.steps(20)                                  # step 7 finishes at t = 5
    assert watch.tick(now=5) == []
    # a 250 s evaluation: the clock is held while the trainer says so
    assert watch.tick(now=10, phase="evaluating") == []
    assert watch.tick(now=260, phase="evaluating") == []
    # it ended at t = 260: the clock runs from there, 99 s later is still within the limit
    assert watch.tick(now=359) == []
    (rec,) = watch.tick(now=361)                       # 101 s after the evaluation ended
    assert rec.values["rule"] == "stalled" and rec.values["stalled_s"] == 101
    assert "evaluating" not in rec.values["message"]
    trainer.steps(20)                                  # step 8 clears it
    assert [r.name for r in watch.tick(now=362)] == ["alert_cleared"]
    # a checkpoint that hangs: held for its 300 s allowance, then counted; the message says so
    assert watch.tick(now=400, phase="saving a checkpoint") == []
    assert watch.tick(now=700, phase="saving a checkpoint") == []    # 300 s into it: held
    assert watch.tick(now=790, phase="saving a checkpoint") == []    # 90 s past the allowance
    (rec,) = watch.tick(now=802, phase="saving a checkpoint")
    assert rec.values["stalled_s"] == 102                            # counted from t = 700
    assert "saving a checkpoint for 402 s, more than the 300 s allowed" in rec.values["message"]
    assert alert_events(run) == [(7, "alert", "stalled"), (8, "alert_cleared", "stalled"),
                                 (8, "alert", "stalled")]


def test_the_heartbeat_thread_passes_the_trainers_phase(user, make_run, settings, wait_until):
    import time

    settings.ALERT_STALL_FACTOR = 5
    settings.ALERT_STALL_MIN_S = 0.3
    settings.ALERT_STALL_PHASE_MAX_S = 1800
    run = make_run(user, "running")
    trainer = Trainer(run)
    trainer.steps(0.05, 0.05, 0.05)
    beat = Heartbeat(run.pk, interval=0.1)
    phase = ["evaluating"]
    beat.phase = lambda: phase[0]
    beat.start()
    try:
        wait_until(lambda: beat.stall.step == 3, 5, "the heartbeat's first look")
        trainer.steps(0.05)
        time.sleep(1.5)                                # 5x the floor, evaluating all along
        assert not RunEvent.objects.filter(run=run, kind="alert").exists()
        phase[0] = None                                # the evaluation ended, no step follows
        wait_until(lambda: RunEvent.objects.filter(run=run, kind="alert", data__rule="stalled").exists(),
                   10, "the stalled alert")
    finally:
        beat.stop()


def test_the_training_task_hands_the_runners_phase_to_its_heartbeat(user, tiny, monkeypatch):
    """The worker's task wires Runner.phase into its Heartbeat: during an evaluation the stall
    watch is told "evaluating"."""
    from trainer import config as config_mod
    from trainer.run import runner as runner_mod
    from webapp.dashboard.models import Status
    from webapp.dashboard.worker import tasks

    beats, seen = [], []

    class RecordingHeartbeat(Heartbeat):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            beats.append(self)

    real_eval = runner_mod.evaluate

    def evaluate(*a, **k):
        seen.append(beats[0].phase())
        return real_eval(*a, **k)

    monkeypatch.setattr(tasks, "Heartbeat", RecordingHeartbeat)
    monkeypatch.setattr(runner_mod, "evaluate", evaluate)
    cfg = config_mod.load("demo", {**tiny, "run.max_steps": 2, "run.eval_every": 2,
                                   "run.eval_size": 4})
    run = Run.objects.create(owner=user, name="phase", config=cfg.to_dict(), knobs=cfg.knob_values(),
                             max_steps=cfg.run.max_steps, status=Status.QUEUED)
    assert tasks.execute(Run.objects.get(pk=run.pk)) == Status.FINISHED
    assert seen and set(seen) == {"evaluating"}
    assert beats[0].phase() is None   # after the run: nothing between steps any more
