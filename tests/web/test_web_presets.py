"""Every shipped preset, launched from the launch form, through the whole run lifecycle on the
real Celery worker (prefork, this setup's broker and database):

    launch (form POST) -> a few steps -> pause -> resume -> tune optim.lr -> stop (checkpoint)
    -> resume from the checkpoint -> kill

driven once per preset by a module fixture, and judged by one test per stage, so a failed check
names its behaviour and hides none after it (a failed wait ends the story: the later stages
fail as not reached).

with, at each stage, the run's status, its step, its rows (at most one point per (key, step),
steps contiguous, the rows up to the checkpoint kept as they were) and the worker's process
tree: whatever a run starts (the async presets' engine child) is gone within seconds of a stop
or a kill. The presets come from the trainer's list, so a new preset gets its test for free.

Every wait is bounded and fails with what it waited for, the run's status/step/error, its last
events, the worker's processes and the end of the worker's log, so a hang fails fast and readably.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
import traceback
from pathlib import Path

import psutil
import pytest
from django.db.models import Count
from django.test import Client

from trainer import config as config_mod
from trainer.run import checkpoint
from webapp.dashboard import actions
from webapp.dashboard.models import ACTIVE, HistogramSnapshot, KnobChange, MetricPoint, Run, RunEvent

# the module fixture writes committed rows (the worker reads them); the tests only judge what it
# recorded (their mark makes pytest-django create the test database)
pytestmark = [pytest.mark.django_db, pytest.mark.slow]

PRESETS = config_mod.preset_names()

# Launch-form fields (as a browser sends them: strings) on top of any preset: a step takes a
# fraction of a second on one core. Sections a preset leaves off are harmless to shrink; the
# 0s mean "derived from the batch size" (APRIL over-sampling, segment length, async in-flight).
SHRINK = {
    "rollout.rollout_batch_size": "2", "rollout.n_samples_per_prompt": "2",
    "rollout.max_response_len": "32", "rollout.max_slots": "8",
    "april.over_sampling_batch_size": "0", "april.segment_max_tokens": "0",
    "async.max_inflight": "0",
    "model.threads": "1", "run.eval_every": "0", "run.reward_workers": "0",
    "run.checkpoint_every": "3", "run.max_steps": "100000",
}
# keys written at every step by every preset (checked for contiguous steps)
EVERY_STEP_KEYS = ("train/policy_version", "timing/step_s")
NEW_LR = 3.5e-5
GONE_WITHIN_S = 10.0   # a stopped or killed run's processes must be gone by then


# On PostgreSQL + Redis one preset tells what the setup changes (database, broker, channel
# layer); what differs between presets is the trainer's, proved by the embedded pass. `all` has
# every technique and an engine child process.
ON_EVERY_SETUP = "all"
SETUP = os.environ.get("RLPILOT_TEST_SETUP", "embedded")   # as conftest reads it


ROOT = Path(__file__).resolve().parents[2]


def opt_in_skip_reason(preset: str) -> str | None:
    """Why an opt-in preset (config.preset_requires: a model directory of its own) cannot run
    here, or None when its model is built in this checkout: `make test` builds smollm2-math's
    (`make sglang-model`: var/models/smollm2-135m-instruct) before pytest starts, so CI runs it.
    (Skipping by preset_requires alone skipped it even there.)"""
    needs = config_mod.preset_requires(preset)
    if not needs:
        return None
    from trainer.models.loading import check_model_dir

    problems = check_model_dir(_built_model(preset))
    return f"{needs}; not built in this checkout: {problems[0]}" if problems else None


def _built_model(preset: str) -> str:
    """Where `make test` (and the CLI, run from the repository) keeps the preset's model."""
    return config_mod.preset_config(preset, project_dir=ROOT, var_dir=ROOT / "var").model.path


def serve_opt_in_model(preset: str) -> None:
    """Put an opt-in preset's built model where this test server looks for it. The web app
    reads a preset's var/models/... under RLPILOT_VAR_DIR, which conftest points at a fresh
    temporary folder, and takes a model.path only inside RLPILOT_MODEL_ROOTS (symlinks followed),
    so the files are hard-linked into it (copied where the two folders are on different devices)."""
    if not config_mod.preset_requires(preset):
        return
    served = Path(actions.shipped_preset(preset).model.path)
    if served.is_dir():
        return
    served.mkdir(parents=True)
    for f in Path(_built_model(preset)).resolve().iterdir():
        try:
            os.link(f.resolve(), served / f.name)
        except OSError:
            shutil.copy2(f.resolve(), served / f.name)


def preset_test_ids():
    """Every preset; an opt-in one whose model directory is not here (see opt_in_skip_reason) is
    skipped, saying why, and on the redis setup all but ON_EVERY_SETUP are (see above)."""
    assert PRESETS, "the trainer ships no preset"
    assert ON_EVERY_SETUP in PRESETS, ON_EVERY_SETUP

    def skip_reason(p):
        if SETUP == "redis" and p != ON_EVERY_SETUP:
            return f"setup-independent: proved by the embedded pass ({ON_EVERY_SETUP} runs on this one)"
        return opt_in_skip_reason(p)

    return [pytest.param(p, marks=pytest.mark.skip(reason=skip_reason(p))) if skip_reason(p) else p
            for p in PRESETS]


# --- processes ----------------------------------------------------------------------------------

def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"


class WorkerTree:
    """The Celery worker's processes. The worker runs in a session of its own
    (conftest: start_new_session), and everything a run starts inherits that session -- even
    an orphan whose parent (a killed pool child) is gone and which was re-parented to init. So
    every live process in the session that is neither the Celery main process nor one of its
    pool children was started by a run."""

    def __init__(self, worker_proc):
        self.main = psutil.Process(worker_proc.p.pid)
        self.sid = os.getsid(self.main.pid)
        self.main_cmd = _cmdline(self.main)

    def session(self) -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == self.sid and _alive(p):
                    out.append(p)
            except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
                continue
        return out

    def pool_children(self) -> list[psutil.Process]:
        out = []
        for p in self.session():
            try:
                if p.ppid() == self.main.pid and _cmdline(p) == self.main_cmd:
                    out.append(p)
            except psutil.NoSuchProcess:
                continue
        return out

    def extras(self) -> list[psutil.Process]:
        """Live processes of the session other than Celery's own (main + pool children)."""
        own = {self.main.pid} | {p.pid for p in self.pool_children()}
        return [p for p in self.session() if p.pid not in own]

    def descendants(self, pid: int) -> list[psutil.Process]:
        try:
            return [p for p in psutil.Process(pid).children(recursive=True) if _alive(p)]
        except psutil.NoSuchProcess:
            return []

    def describe(self) -> str:
        lines = []
        for p in sorted(self.session(), key=lambda p: p.pid):
            try:
                lines.append(f"  pid {p.pid} ppid {p.ppid()} {p.status()}: {_cmdline(p)[:160]}")
            except psutil.NoSuchProcess:
                pass
        return "\n".join(lines) or "  (none)"


def engine_child_marker() -> str | None:
    """What the async engine child's command line carries (trainer/engine/process.py)."""
    from trainer.engine import process

    return getattr(process, "CHILD_MODULE", None)


def expects_engine_child(cfg: dict) -> bool:
    """Does this config decode in a child process (async.worker = process, embedded engine)?"""
    a = cfg.get("async", {})
    return bool(a.get("enabled")) and a.get("worker") == "process" \
        and cfg.get("rollout", {}).get("engine", "embedded") == "embedded"


def pool_pid(run: Run) -> int:
    m = re.search(r":(\d+)$", run.worker_host or "")
    assert m, f"worker_host {run.worker_host!r} does not end in :pid"
    return int(m.group(1))


# --- the run, its rows and bounded waits ---------------------------------------------------------

class Lifecycle:
    def __init__(self, client: Client, csrf: str, worker, tree: WorkerTree):
        self.client, self.csrf, self.worker, self.tree = client, csrf, worker, tree
        self.rid: int | None = None
        self.t0 = time.monotonic()
        self.timings: list[tuple[str, float]] = []
        self.seen: dict[int, psutil.Process] = {}   # every engine child seen, to check it is gone
        self.page = ""       # the runs page with the launch form
        self.preset = "?"

    def run(self) -> Run:
        return Run.objects.get(pk=self.rid)

    def post(self, path: str, data=None):
        return self.client.post(path, json.dumps(data or {}), content_type="application/json",
                                HTTP_X_CSRFTOKEN=self.csrf)

    def control(self, action: str) -> None:
        r = self.post(f"/api/runs/{self.rid}/{action}")
        assert r.status_code == 202, f"{action}: {r.status_code} {r.content[:500]!r}\n{self.describe()}"

    def describe(self) -> str:
        out = []
        if self.rid is not None:
            run = Run.objects.filter(pk=self.rid).first()
            if run is not None:
                out.append(f"run {run.pk}: status={run.status} desired={run.desired} step={run.step} "
                           f"worker={run.worker_host} attempts={run.attempts} error={run.error[:1500]!r}")
                evs = list(RunEvent.objects.filter(run_id=self.rid).order_by("-seq")[:15])
                out.append("last events (newest last):")
                for e in reversed(evs):
                    out.append(f"  #{e.seq} step {e.step} {e.kind} {json.dumps(e.data, default=str)[:300]}")
        out.append(f"worker session processes:\n{self.tree.describe()}")
        out.append("worker log (end):\n" + self.worker.text()[-3000:])
        return "\n".join(out)

    def wait(self, predicate, timeout: float, what: str, interval: float = 0.2):
        start = time.monotonic()
        deadline = start + timeout
        while True:
            value = predicate()
            if value:
                self.timings.append((what, time.monotonic() - start))
                return value
            if time.monotonic() >= deadline:
                break
            time.sleep(interval)
        pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} "
                    f"({time.monotonic() - self.t0:.1f} s into the test)\n{self.describe()}", pytrace=False)

    def wait_status(self, statuses, timeout: float, what: str, min_step: int | None = None) -> Run:
        statuses = (statuses,) if isinstance(statuses, str) else tuple(statuses)

        def ok():
            run = self.run()
            if run.status in ("failed", "interrupted") and run.status not in statuses:
                pytest.fail(f"the run became {run.status} while waiting for {what}\n{self.describe()}",
                            pytrace=False)
            return run if run.status in statuses and (min_step is None or run.step >= min_step) else None
        return self.wait(ok, timeout, what)

    def event(self, kind: str, after_seq: int = 0, **data_match) -> RunEvent | None:
        for e in RunEvent.objects.filter(run_id=self.rid, kind=kind, seq__gt=after_seq).order_by("seq"):
            if all(e.data.get(k) == v for k, v in data_match.items()):
                return e
        return None

    def last_seq(self) -> int:
        return self.run().last_seq

    def max_point_step(self) -> int:
        return max(MetricPoint.objects.filter(run_id=self.rid).values_list("step", flat=True), default=0)

    # rows: complete (contiguous steps) and unduplicated
    def check_rows(self, upto: int | None = None, settled: bool = False) -> int:
        """No (key, step) twice; every-step keys contiguous from step 1 (and at least to `upto`).
        `settled`: the run writes nothing now, so every such key ends at the same step (while it
        runs, a snapshot may fall between two steps' writes)."""
        dup_points = list(MetricPoint.objects.filter(run_id=self.rid).values("key", "step")
                          .annotate(n=Count("id")).filter(n__gt=1)[:10])
        assert not dup_points, f"duplicated metric points (key, step, n): {dup_points}\n{self.describe()}"
        dup_hists = list(HistogramSnapshot.objects.filter(run_id=self.rid).values("name", "step")
                         .annotate(n=Count("id")).filter(n__gt=1)[:10])
        assert not dup_hists, f"duplicated histograms (name, step, n): {dup_hists}\n{self.describe()}"
        rows = list(MetricPoint.objects.filter(run_id=self.rid, key__in=EVERY_STEP_KEYS)
                    .values_list("key", "step", "value"))   # one query: one snapshot
        tops = {}
        for key in EVERY_STEP_KEYS:
            steps = sorted(s for k, s, _ in rows if k == key)
            assert steps, f"no {key!r} rows\n{self.describe()}"
            assert steps == list(range(1, steps[-1] + 1)), \
                f"{key!r}: steps not contiguous from 1: {steps}\n{self.describe()}"
            tops[key] = steps[-1]
        top = min(tops.values())
        if settled:
            assert len(set(tops.values())) == 1, f"every-step keys end at different steps: {tops}"
        if upto is not None:
            assert top >= upto, f"rows stop at step {top}, the run is at step {upto}\n{self.describe()}"
        wrong = {s: v for k, s, v in rows if k == "train/policy_version" and v != s}
        assert not wrong, f"train/policy_version != step at {wrong} (the weights went back?)"
        return top

    # processes
    def engine_children(self, pool: int) -> list[psutil.Process]:
        marker = engine_child_marker()
        kids = [p for p in self.tree.descendants(pool) if marker is None or marker in _cmdline(p)]
        self.seen.update((p.pid, p) for p in kids)
        return kids

    def wait_no_leftovers(self, what: str, old_pool: psutil.Process | None = None) -> None:
        """No process a run started survives: the worker's session holds only Celery's own
        processes (main + pool children), and the given (killed) pool child is gone."""
        def clean():
            if old_pool is not None and _alive(old_pool):
                return False
            # psutil.Process remembers the start time: a reused pid does not count as alive
            return not self.tree.extras() and not any(_alive(p) for p in self.seen.values())
        try:
            self.wait(clean, GONE_WITHIN_S, f"no process left behind after {what}", interval=0.1)
        except pytest.fail.Exception:
            left = {p.pid: p for p in self.tree.extras()}
            left.update((p.pid, p) for p in self.seen.values() if _alive(p))
            leftovers = "\n".join(f"  pid {p.pid}: {_cmdline(p)[:200]}" for p in left.values())
            raise AssertionError(f"processes still alive {GONE_WITHIN_S} s after {what}:\n{leftovers}\n"
                                 f"{self.describe()}") from None


# --- one preset's story, driven once, judged stage by stage -----------------------------------------

STAGES = ("launch", "pause", "resume", "tune", "stop", "resume_from_checkpoint", "kill")


class Story:
    """One preset's lifecycle, driven once by the module fixture; each stage's failures are kept
    for the test named after it. A failed wait (or a check the next stages need) ends the story:
    the later stages fail as not reached. Any other failed check is recorded and the story goes
    on, so it hides nothing after it."""

    def __init__(self, preset: str):
        self.preset = preset
        self.failures: dict[str, list[str]] = {s: [] for s in STAGES}
        self.current = ""
        self.broken = ""   # the stage that ended the story
        self.ran: set[str] = set()

    def drive(self, stages) -> None:
        for name, fn in stages:
            if self.broken:
                self.failures[name].append(f"not reached: the {self.broken!r} stage failed")
                continue
            self.current = name
            self.ran.add(name)
            try:
                fn()
            except (AssertionError, pytest.fail.Exception) as e:
                self.failures[name].append(str(e))
                self.broken = name
            except Exception:
                self.failures[name].append(traceback.format_exc())
                self.broken = name

    def expect(self, ok: bool, message: str) -> None:
        """A check the later stages do not depend on: recorded, not raised."""
        if not ok:
            self.failures[self.current].append(message)

    def soft(self, check, *args, **kwargs):
        try:
            return check(*args, **kwargs)
        except AssertionError as e:
            self.failures[self.current].append(str(e))
            return None

    def verdict(self, stage: str) -> None:
        assert stage in self.ran or self.failures[stage], f"the {stage!r} stage was never driven"
        if self.failures[stage]:
            pytest.fail(f"[{self.preset}] {stage}:\n" + "\n\n".join(self.failures[stage]), pytrace=False)


def drive_lifecycle(lc: Lifecycle, story: Story, setup_name: str) -> None:
    """launch -> a few steps -> pause -> resume -> tune optim.lr -> stop -> resume from the
    checkpoint -> kill, on the real worker."""
    preset, st = story.preset, {}
    expect, soft = story.expect, story.soft

    def launch():
        # launch from the form (the real view, CSRF and all), the preset picked from its list
        assert f'<option value="{preset}"' in lc.page, f"the launch form does not offer preset {preset!r}"
        form = {"csrfmiddlewaretoken": lc.csrf, "name": f"preset-{preset}-{setup_name}", "preset": preset,
                "toml": "", "queue": ""}
        form.update({f"cfg:{k}": v for k, v in SHRINK.items()})
        r = lc.client.post("/", form)
        assert r.status_code == 302, f"launch refused ({r.status_code}): {r.content.decode()[-3000:]}"
        m = re.match(r"^/runs/(\d+)/$", r["Location"])
        assert m, r["Location"]
        lc.rid = int(m.group(1))
        run = lc.run()
        st["config"] = run.config
        expect(run.preset == preset and run.config["rollout"]["rollout_batch_size"] == 2,
               f"the run's preset / shrink: {run.preset} {run.config['rollout']}")
        base = config_mod.from_dict(config_mod.preset_dict(preset))
        for section, part in (("april", base.april), ("greso", base.greso), ("async", base.async_)):
            expect(run.config[section]["enabled"] == part.enabled, f"{section}.enabled changed by the shrink")
        st["child"] = child_expected = expects_engine_child(run.config)
        # it runs a few steps on the worker
        run = lc.wait_status("running", 120, "the run to reach step 3", min_step=3)
        st["pool"] = pool = pool_pid(run)
        assert pool in {p.pid for p in lc.tree.pool_children()}, \
            f"worker_host pid {pool} is not a pool child of the Celery worker\n{lc.describe()}"
        children = lc.engine_children(pool)
        if child_expected:
            expect(bool(children), f"{preset}: async.worker=process but no engine child under pool pid "
                                   f"{pool}\n{lc.describe()}")
            expect({p.pid for p in children} <= {p.pid for p in lc.tree.extras()},
                   "the engine child is not in the worker's session")
        else:
            expect(not lc.tree.extras(), f"{preset}: unexpected processes during the run\n{lc.describe()}")
        soft(lc.check_rows)

    def pause():
        # held at a step boundary, the step stops advancing
        lc.control("pause")
        run = lc.wait_status("paused", 60, "status paused")
        paused_step, paused_rows = run.step, lc.max_point_step()
        st["paused_step"] = paused_step
        expect(bool(lc.event("paused")), f"no paused event\n{lc.describe()}")
        time.sleep(1.5)
        run = lc.run()
        expect(run.status == "paused" and run.step == paused_step and lc.max_point_step() == paused_rows,
               f"the paused run advanced: step {paused_step} -> {run.step}\n{lc.describe()}")
        if st["child"]:
            expect(bool(lc.engine_children(st["pool"])), "the engine child went away during a pause")

    def resume():
        lc.control("resume")
        lc.wait_status("running", 60, "running again after the pause", min_step=st["paused_step"] + 1)
        expect(bool(lc.event("resumed")), f"no resumed event\n{lc.describe()}")

    def tune():
        # applied at a step boundary, recorded with its step, in effect from the next step
        asked_at = lc.run().step
        r = lc.post(f"/api/runs/{lc.rid}/knobs", {"optim.lr": NEW_LR})
        assert r.status_code == 202, r.content
        change_id = r.json()["change_ids"][0] if "change_ids" in r.json() else r.json()["change_id"]
        applied = lc.wait(lambda: lc.event("knob_applied", change_id=change_id), 60, f"knob_applied {change_id}")
        st["applied_step"] = applied.step
        expect(applied.step >= asked_at, f"applied at step {applied.step}, asked at {asked_at}")
        expect(applied.data["changes"]["optim.lr"] == {"old": st["config"]["optim"]["lr"], "new": NEW_LR},
               f"recorded change {applied.data['changes']}")
        kc = KnobChange.objects.get(run_id=lc.rid, change_id=change_id)
        expect(kc.status == KnobChange.APPLIED and kc.applied_step == applied.step,
               f"the change's row: {kc.status} at {kc.applied_step}")
        expect(lc.run().knobs["optim.lr"] == NEW_LR, f"Run.knobs: {lc.run().knobs.get('optim.lr')}")
        lr_next = lc.wait(lambda: MetricPoint.objects.filter(run_id=lc.rid, key="actor/lr",
                                                             step=applied.step + 1).first(),
                          60, f"actor/lr at step {applied.step + 1} (after the knob_applied step)")
        expect(lr_next.value == pytest.approx(NEW_LR), f"actor/lr {lr_next.value} after the change to {NEW_LR}")

    def stop():
        # cooperative; the trainer checkpoints and the task ends; its processes go
        lc.control("stop")
        run = lc.wait_status("stopped", 90, "status stopped")
        st["stopped_at"] = stopped_at = run.step
        expect(stopped_at >= st["applied_step"] + 1, f"stopped at {stopped_at}, before the change's next step")
        ckpt = checkpoint.latest_step(actions.run_dir(lc.rid))
        assert ckpt == stopped_at, f"no checkpoint at the stop step {stopped_at}: " \
            f"{[p.name for p in (actions.run_dir(lc.rid) / 'checkpoints').glob('*')]}"
        expect(bool(lc.event("stop_requested") and lc.event("run_stopped")), "no stop_requested / run_stopped")
        expect(RunEvent.objects.filter(run_id=lc.rid, kind="checkpoint", step=stopped_at).exists(),
               f"no checkpoint event at step {stopped_at}")
        lc.wait_no_leftovers("a stop")
        expect(_alive(psutil.Process(st["pool"])), "a cooperative stop took the pool child down")
        expect(soft(lc.check_rows, upto=stopped_at, settled=True) in (stopped_at, None),
               f"the rows do not end at the stop step {stopped_at}")
        st["rows_before"] = dict(MetricPoint.objects.filter(run_id=lc.rid).values_list("id", "seq"))
        st["seq_at_stop"] = lc.last_seq()

    def resume_from_checkpoint():
        stopped_at, seq_at_stop = st["stopped_at"], st["seq_at_stop"]
        lc.control("resume")
        run = lc.wait_status("running", 120, f"running again from the checkpoint (step {stopped_at})",
                             min_step=stopped_at + 2)
        rewound = lc.event("rewound", after_seq=seq_at_stop)
        expect(bool(rewound) and rewound.data == {"step": stopped_at, "from_checkpoint": True},
               f"rewound: {rewound and rewound.data}\n{lc.describe()}")
        resumed = lc.event("run_resumed", after_seq=seq_at_stop)
        expect(bool(resumed) and resumed.step == stopped_at, f"run_resumed: {resumed and resumed.step}")
        expect(run.attempts == 2, f"attempts {run.attempts}")
        # the rows up to the checkpoint are the ones written before the stop, not rewritten
        expect(not MetricPoint.objects.filter(run_id=lc.rid, step__lte=stopped_at, seq__gt=seq_at_stop).exists(),
               "rows up to the checkpoint were rewritten")
        expect(not MetricPoint.objects.filter(run_id=lc.rid, step__gt=stopped_at, seq__lte=seq_at_stop).exists(),
               "rows past the checkpoint from before the stop survived")
        expect(dict(MetricPoint.objects.filter(run_id=lc.rid, step__lte=stopped_at).values_list("id", "seq"))
               == st["rows_before"], "the rows up to the checkpoint changed")
        soft(lc.check_rows, upto=stopped_at + 2)
        expect(lc.run().knobs["optim.lr"] == NEW_LR, "the tuned lr was lost on resume")
        st["pool"] = pool = pool_pid(run)
        st["pool_proc"] = psutil.Process(pool)
        if st["child"]:
            expect(bool(lc.engine_children(pool)), f"the resumed run has no engine child\n{lc.describe()}")
        else:
            expect(not lc.tree.extras(), lc.describe())

    def kill():
        # SIGKILL of the pool child; the status says so at once, nothing survives
        lc.control("kill")
        run = lc.run()
        assert run.status == "stopped" and run.desired == "stop", (run.status, run.desired)
        killed = lc.event("killed")
        assert killed, lc.describe()
        lc.wait_no_leftovers("a kill", old_pool=st["pool_proc"])
        last = lc.last_seq()
        time.sleep(1.0)
        expect(lc.last_seq() == last, "the killed run is still writing")
        expect(not lc.event("run_stopped", after_seq=killed.seq), "the run stopped cooperatively, not killed")
        expect(lc.run().status == "stopped", f"status {lc.run().status} after the kill")
        soft(lc.check_rows, settled=True)

    story.drive([("launch", launch), ("pause", pause), ("resume", resume), ("tune", tune), ("stop", stop),
                 ("resume_from_checkpoint", resume_from_checkpoint), ("kill", kill)])


@pytest.fixture(scope="module", params=preset_test_ids())
def story(request, django_db_setup, django_db_blocker, celery_worker, setup_name):
    """One preset's lifecycle on the worker, driven once for all the tests of that preset. The
    rows are committed (the worker and the server read them), so the run and its owner are
    deleted at the end."""
    from django.contrib.auth import get_user_model

    preset = request.param
    with django_db_blocker.unblock():
        owner = get_user_model().objects.create_user(f"presets-{preset}")
        browser = Client(enforce_csrf_checks=True)   # browser-like: enforces CSRF
        browser.force_login(owner)
        tree = WorkerTree(celery_worker)
        # a previous preset's killed pool child is replaced before this one starts
        deadline = time.monotonic() + 30
        while not tree.pool_children() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tree.pool_children(), f"the Celery worker has no pool child:\n{tree.describe()}"
        assert not tree.extras(), f"processes left from an earlier test:\n{tree.describe()}"
        page = browser.get("/")
        assert page.status_code == 200
        lc = Lifecycle(browser, browser.cookies["csrftoken"].value, celery_worker, tree)
        lc.page, lc.preset = page.content.decode(), preset
        st = Story(preset)
        try:
            serve_opt_in_model(preset)
            drive_lifecycle(lc, st, setup_name)
            yield st
        finally:
            # a failed story must not leave its run on the (single) worker for the next one
            run = Run.objects.filter(pk=lc.rid).first() if lc.rid is not None else None
            if run is not None and run.status in ACTIVE:
                try:
                    actions.control(run, owner, "kill")
                except actions.ActionError:
                    pass
                deadline = time.monotonic() + 20
                while tree.extras() and time.monotonic() < deadline:
                    time.sleep(0.2)
            Run.objects.filter(owner=owner).delete()
            owner.delete()
            timings = ", ".join(f"{w}: {s:.1f}s" for w, s in lc.timings)
            print(f"\n[{preset}] {time.monotonic() - lc.t0:.1f} s; {timings}")


# --- the tests: one per stage, for every preset -----------------------------------------------------

def test_launch_from_the_form_runs_on_the_worker(story):
    story.verdict("launch")


def test_pause_holds_the_run_at_a_step_boundary(story):
    story.verdict("pause")


def test_resume_continues_a_paused_run(story):
    story.verdict("resume")


def test_a_knob_change_applies_at_the_next_step_boundary(story):
    story.verdict("tune")


def test_stop_checkpoints_and_leaves_no_process(story):
    story.verdict("stop")


def test_resume_from_the_checkpoint_keeps_the_rows_before_it(story):
    story.verdict("resume_from_checkpoint")


def test_kill_ends_the_run_at_once_and_leaves_no_process(story):
    story.verdict("kill")
