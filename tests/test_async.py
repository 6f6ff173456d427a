"""Asynchronous training: the staleness rule, eta = 0 equals the synchronous loop, the bound
holds (also after a resume), and stop/pause reach the generation worker promptly."""
import threading

import pytest
import torch

from trainer import config as C
from trainer.observe.metrics import MemorySink
from trainer.rollout.asynchronous import AsyncDriver, admission_allowed
from trainer.rollout.asynchronous.worker import GenerationWorker
from trainer.run.controls import PAUSE, RESUME, STOP, Command, ControlSource
from trainer.run.runner import Runner

BASE = ["rollout.rollout_batch_size=6", "rollout.n_samples_per_prompt=4",
        "rollout.max_response_len=64", "rollout.max_slots=16", "run.eval_every=0",
        "run.checkpoint_every=0", "run.reward_workers=0", "model.threads=1",
        "async.worker=thread"]


def run(tmp_path, extra, steps=3, controls=None, resume=False):
    cfg = C.load("demo", BASE + extra + [f"run.max_steps={steps}"])
    sink = MemorySink()
    with Runner(cfg, tmp_path, sink=sink, controls=controls, resume=resume,
                system_telemetry=False) as r:
        status = r.run()
    return r, sink, status


def weights(r):
    return torch.cat([p.detach().flatten() for p in r.model.parameters()])


def test_admission_rule_by_hand():
    # eta 2, version 0, B 4: (2 + 0 + 1) * 4 = 12 groups may be accepted or running
    assert admission_allowed(accepted=0, running=11, version=0, eta=2, batch=4)
    assert not admission_allowed(accepted=4, running=8, version=0, eta=2, batch=4)
    assert admission_allowed(accepted=4, running=8, version=1, eta=2, batch=4)
    # eta 0: exactly one batch per version
    assert admission_allowed(0, 3, 0, 0, 4) and not admission_allowed(0, 4, 0, 0, 4)


def test_inflight_cap_and_staleness_verdicts_by_hand():
    from trainer.rollout.asynchronous.admission import inflight_cap, oldest_first, too_stale

    # B 6, G 4, 16 slots: 0 means 2B = 12 groups; 4 rounds of the slots fit 4 x 16 / 4 = 16 groups
    assert inflight_cap(0, 6, 16, 0, 4) == 12
    assert inflight_cap(3889, 6, 16, 0, 4) == 16 and inflight_cap(3889, 6, 16, 2, 4) == 32
    assert inflight_cap(0, 6, 1, 0, 8) == 1            # 4 x 1 / 8 = 0 groups fit: still one
    # version 3, eta 1: a group whose oldest token is from version 1 is 2 old, too stale
    assert too_stale(3, 1, 1) and not too_stale(3, 2, 1)
    queue = [_finished_group(3, 0), _finished_group(1, 1), _finished_group(1, 2)]
    assert oldest_first(queue, 3) == 1                 # oldest token first, the first on a tie


@pytest.mark.parametrize("prox", ["recompute", "loglinear"])
def test_eta_zero_reproduces_the_synchronous_loop(tmp_path, prox):
    sync, s_sink, _ = run(tmp_path / "sync", [])
    if True:
        asy, a_sink, _ = run(tmp_path / prox, ["async.enabled=true", "async.max_staleness=0",
                                               f"async.prox_logp={prox}"])
        for key in ("reward/mean", "rollout/response_len/mean", "rollout/trained_tokens"):
            assert a_sink.series(key) == s_sink.series(key), key
        assert a_sink.series("async/staleness/max") == [0, 0, 0]
        # same rollouts, same update; pi_prox is recomputed by the trainer instead of taken
        # from the engine, which differs in the last float bits
        assert torch.allclose(weights(asy), weights(sync), atol=1e-4)


@pytest.mark.parametrize("eta", [0, 1])
def test_engine_in_its_own_process_respects_the_bound(tmp_path, eta):
    # decoding in a child process runs truly concurrently, so batches (and sampled tokens)
    # differ from the synchronous loop's; the staleness bound must hold all the same
    r, sink, status = run(tmp_path, ["async.enabled=true", "async.worker=process",
                                     f"async.max_staleness={eta}"], steps=3)
    assert status == "finished" and r.step == 3
    assert max(sink.series("async/staleness/max")) <= eta
    assert sum(sink.series("rollout/trained_tokens")) > 0
    assert r.engine.processes and all(p.poll() is not None for p in r.engine.processes)  # the engine child has exited


def _instrument(monkeypatch):
    """Record accepted + running and the bound at every admission."""
    seen = []
    real = GenerationWorker.launch

    def launch(self, g, samples):
        real(self, g, samples)
        state = self.state
        cfg = state.cfg
        bound = (cfg.async_.max_staleness + state.version + 1) * cfg.rollout.rollout_batch_size
        seen.append((state.accepted + len(state.running), bound))

    monkeypatch.setattr(GenerationWorker, "launch", launch)
    return seen


def test_staleness_bound_holds_and_after_resume(tmp_path, monkeypatch):
    seen = _instrument(monkeypatch)
    extra = ["async.enabled=true", "async.max_staleness=1", "run.checkpoint_every=2"]
    r, sink, _ = run(tmp_path, extra, steps=4)
    assert max(sink.series("async/staleness/max")) <= 1
    assert all(n <= bound for n, bound in seen)
    seen.clear()
    r2, sink2, _ = run(tmp_path, extra, steps=7, resume=True)
    assert r2.step == 7 and sink2.events[0]["kind"] == "run_resumed"
    assert max(sink2.series("async/staleness/max")) <= 1
    assert seen and all(n <= bound for n, bound in seen)
    # the first admissions after the resume are bounded by the restored version (4), not 0
    assert seen[0][1] == (1 + 4 + 1) * 6


class Scripted(ControlSource):
    def __init__(self, script):
        self.script = list(script)

    def poll(self):
        return self.script.pop(0) if self.script else []


def test_stop_reaches_the_worker_and_no_thread_is_left(tmp_path):
    ref = []
    cfg = C.load("demo", BASE + ["async.enabled=true", "run.max_steps=50"])
    with Runner(cfg, tmp_path, sink=MemorySink(), controls=AtStep(ref, {2: Command(STOP)}),
                system_telemetry=False) as r:
        ref.append(r)
        status = r.run()
    sink = r.sink
    assert status == "stopped" and r.step == 2
    assert not [t for t in threading.enumerate() if t.name == "rlpilot-generator"]
    assert sink.events[-1]["kind"] == "run_stopped"


def test_pause_holds_generation(tmp_path):
    decode_steps = []

    class Watch(Scripted):
        def poll(self):
            out = super().poll()
            decode_steps.append(runner_ref[0].engine.stats.decode_steps)
            return out

    runner_ref = []
    cfg = C.load("demo", BASE + ["async.enabled=true", "run.max_steps=3"])
    script = [[], [Command(PAUSE)]] + [[]] * 6 + [[Command(RESUME)]]
    with Runner(cfg, tmp_path, sink=MemorySink(), controls=Watch(script),
                system_telemetry=False) as r:
        runner_ref.append(r)
        assert r.run() == "finished"
    paused = decode_steps[3:8]  # polls while paused, after the worker settled
    assert len(set(paused)) == 1, decode_steps


# --- the loop can never wait forever ------------------------------------------------------------

class IdleEngine:
    """An engine with nothing to do (the worker only admits and waits)."""
    num_pending = 0
    version = 0

    def submit(self, samples):
        for s in samples:
            s.finish_reason = None

    def step(self):
        return []

    def abort(self, request_ids=None, keep_cache=False):
        return []


def _finished_group(version: int, draw: int):
    from trainer.engine.base import STOP, Sample
    from trainer.rollout import Group
    from trainer.tasks.base import Problem

    s = Sample([1, 2], response_ids=[3], logprobs=[-0.1], versions=[version], finish_reason=STOP)
    return Group(problem=Problem(f"p{draw}", "[1]=", 1, "sum"), samples=[s], rewards=[1.0],
                 draw=draw)


def _cfg(**knobs):
    return C.load("demo", BASE + [f"{k}={v}" for k, v in knobs.items()])


def test_a_stale_drop_gives_its_admission_back():
    # B = 1, version 3, eta 1: the two groups from version 0 are dropped, the fresh one taken;
    # accepted falls from 3 to 1 (only the group trained), as AReaL counts rejected rollouts
    cfg = _cfg(**{"rollout.rollout_batch_size": 1, "async.max_staleness": 1})
    ar = AsyncDriver(IdleEngine(), None, None, None, lock=threading.RLock())
    ar.state.cfg, ar.state.version = cfg, 3
    ar.state.queue.extend([_finished_group(0, 0), _finished_group(0, 1), _finished_group(3, 2)])
    ar.state.accepted = 3
    ar.worker._thread = threading.current_thread()  # collect() only checks that a worker exists
    res = ar.collect(cfg, 3)
    assert [g.draw for g in res.groups] == [2]
    assert ar.state.accepted == 1 and ar.state.dropped_stale == 2
    assert res.metrics["async/accepted"] == 1 and res.metrics["async/admission_bound"] == 5
    assert res.counts.discarded_tokens == 2


def test_a_segment_stop_one_version_before_stale_runs_to_its_end():
    """APRIL's segment limit under asynchronous training: a parked sample goes to the back of the
    queue, unless its group is eta versions old (one more and it is stale when the trainer takes
    it): then it is its last chance, resubmitted without a segment limit."""
    from trainer.engine.base import SEGMENT, Sample, SamplingParams
    from trainer.rollout import Group
    from trainer.tasks.base import Problem

    cfg = _cfg(**{"async.max_staleness": 2, "april.enabled": "true", "april.segment_max_tokens": 4})
    submitted = []

    class Requeue(IdleEngine):
        def submit(self, samples):
            submitted.extend(samples)

    ar = AsyncDriver(Requeue(), None, None, None, lock=threading.RLock())
    ar.state.cfg, ar.state.version = cfg, 5
    parked = {}
    for first in (3, 4):   # oldest token 2 versions old (at eta), and 1
        s = Sample([1, 2], SamplingParams(segment_max_tokens=4), response_ids=[3] * 4,
                   logprobs=[-0.1] * 4, versions=[first] * 4, finish_reason=SEGMENT)
        g = Group(problem=Problem(f"p{first}", "[1]=", 1, "sum"), samples=[s], draw=first)
        ar.state.owner[s.request_id], ar.state.running[id(g)] = g, g
        parked[first] = s
    ar.worker.handle(list(parked.values()))
    assert submitted == [parked[3], parked[4]]
    assert parked[3].params.segment_max_tokens is None    # its last chance
    assert parked[4].params.segment_max_tokens == 4       # back of the queue, segmented


def test_the_trainer_takes_the_oldest_queued_groups_first():
    # B = 2, version 3, eta 2. Queued in completion order: two fresh groups (version 3), then
    # two that a long answer kept in flight since version 1. Taking in completion order would
    # train the fresh pair and leave the old pair to fall out of the bound at version 4;
    # oldest first trains the old pair now (draws 2, 3), and the fresh pair stays queued.
    cfg = _cfg(**{"rollout.rollout_batch_size": 2, "async.max_staleness": 2})
    ar = AsyncDriver(IdleEngine(), None, None, None, lock=threading.RLock())
    ar.state.cfg, ar.state.version = cfg, 3
    ar.state.queue.extend([_finished_group(3, 0), _finished_group(3, 1), _finished_group(1, 2),
                     _finished_group(1, 3)])
    ar.state.accepted = 4
    ar.worker._thread = threading.current_thread()
    res = ar.collect(cfg, 3)
    assert [g.draw for g in res.groups] == [2, 3]
    assert sorted(res.staleness) == [2, 2]
    assert [g.draw for g in ar.state.queue] == [0, 1] and ar.state.dropped_stale == 0
    assert res.metrics["async/queue_size"] == 2


def test_suspending_hands_finished_samples_to_the_worker_before_an_evaluation():
    # the engine in its own process may hold a finished sample it has not handed out yet (it
    # came in while the parent waited for the abort's reply). suspended() must take it: the
    # evaluation's generate() would otherwise take it, and its group would wait forever
    from trainer.engine.base import STOP, Sample, SamplingParams
    from trainer.rollout import Group
    from trainer.tasks.base import Problem

    class HoldingEngine(IdleEngine):
        def __init__(self, done):
            self.done = list(done)

        @property
        def num_pending(self):
            return len(self.done)

        def step(self):
            out, self.done = self.done, []
            return out

    s = Sample([1, 2], SamplingParams(max_new_tokens=4), response_ids=[3], logprobs=[-0.1],
               versions=[0], finish_reason=STOP)
    g = Group(problem=Problem("p0", "[1]=", 1, "sum"), samples=[s], draw=0)
    eng = HoldingEngine([s])
    ar = AsyncDriver(eng, None, None, lambda groups: [x.rewards.append(1.0) for x in groups],
                     lock=threading.RLock())
    ar.state.cfg, ar.state.version = _cfg(), 0
    ar.state.running[id(g)], ar.state.owner[s.request_id] = g, g
    ar.worker._thread = threading.current_thread()   # a worker exists (and is idle)
    ar.worker._idle.set()
    with ar.suspended():
        assert eng.num_pending == 0             # nothing left for the evaluation to take
        assert list(ar.state.queue) == [g] and not ar.state.running and ar.state.accepted == 1
    assert g.rewards == [1.0]


def test_a_deadlock_is_raised_with_the_admission_counters():
    from trainer.rollout.asynchronous import AsyncStall

    # accepted inflated past the bound (what stale drops used to do): nothing can be admitted
    cfg = _cfg(**{"rollout.rollout_batch_size": 2, "async.max_staleness": 0})
    ar = AsyncDriver(IdleEngine(), None, None, None, lock=threading.RLock())
    ar.state.accepted = 4
    ar.start(cfg, version=1)
    try:
        with pytest.raises(AsyncStall) as err:
            ar.collect(cfg, 1)
    finally:
        ar.close()
    msg = str(err.value)
    for part in ("deadlocked", "accepted=4", "running=0", "queued=0", "taken=0/2",
                 "bound=(eta 0 + version 1 + 1) x B 2 = 4"):
        assert part in msg, msg


def test_no_progress_times_out_with_the_counters(monkeypatch):
    from trainer.rollout.asynchronous import AsyncStall

    # a group admitted but never finishing (an engine that hangs): the deadline fires
    class Hung(IdleEngine):
        num_pending = 1

    cfg = _cfg(**{"rollout.rollout_batch_size": 1, "async.collect_timeout_s": 1})
    tok = load_builtin_tokenizer()
    ar = AsyncDriver(Hung(), tok, _one_prompt, lambda gs: None, lock=threading.RLock())
    ar.start(cfg, version=0)
    try:
        with pytest.raises(AsyncStall, match=r"no generation progress for 1 s .*running=\d"):
            ar.collect(cfg, 0)
    finally:
        ar.close()


def load_builtin_tokenizer():
    from trainer.models.loading import load_tokenizer

    return load_tokenizer("builtin")


def _one_prompt(cfg, counts):
    from trainer.tasks.base import Problem

    return 0, Problem("p0", "[1]=", 1, "sum")


class AtStep(ControlSource):
    """Commands to send at given step boundaries (polled once per boundary while running)."""

    def __init__(self, runner_ref, plan):
        self.ref, self.plan, self.sent = runner_ref, dict(plan), set()

    def poll(self):
        step = self.ref[0].step
        if step in self.plan and step not in self.sent:
            self.sent.add(step)
            return [self.plan[step]]
        return []


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_eta_lowered_to_zero_and_raised_again_keeps_training(tmp_path, worker):
    from trainer.run.controls import SET_KNOBS

    cfg = C.load("demo", BASE + ["async.enabled=true", f"async.worker={worker}",
                                 "async.max_staleness=2", "run.max_steps=9"])
    ref, sink = [], MemorySink()
    plan = {3: Command(SET_KNOBS, knobs={"async.max_staleness": 0}),
            6: Command(SET_KNOBS, knobs={"async.max_staleness": 2})}
    with Runner(cfg, tmp_path, sink=sink, controls=AtStep(ref, plan),
                system_telemetry=False) as r:
        ref.append(r)
        assert r.run() == "finished" and r.step == 9
    applied = [e for e in sink.events if e["kind"] == "knob_applied"]
    assert [e["step"] for e in applied] == [3, 6]
    stale = sink.series("async/staleness/max")
    assert max(stale[3:6]) == 0 and max(stale) <= 2  # steps 4..6 trained under eta = 0


def test_auto_staleness_cannot_deadlock(tmp_path, monkeypatch):
    # behaviour weights far from 1 every step: auto eta tightens 2 -> 1 -> 0 and stays there;
    # the run still trains every step
    real = AsyncDriver.retune

    def drifting(self, cfg, tm):
        return real(self, cfg, {**tm, "actor/behave_imp_weight": 1.5})

    monkeypatch.setattr(AsyncDriver, "retune", drifting)
    r, sink, status = run(tmp_path, ["async.enabled=true", "async.auto_staleness=true",
                                     "async.max_staleness=2", "async.prox_logp=loglinear"],
                          steps=7)
    assert status == "finished" and r.step == 7
    # each change is a knob change from "auto", applied at the next step boundary with the
    # evidence that caused it
    applied = [e for e in sink.events if e["kind"] == "knob_applied"]
    assert [e["changes"]["async.max_staleness"]["new"] for e in applied] == [1, 0]
    assert {e["requested_by"] for e in applied} == {"auto"}
    assert [e["step"] for e in applied] == [1, 2]
    assert applied[0]["reason"] == {"rule": "auto_staleness", "behave_imp_weight": 1.5,
                                    "capped_ratio": applied[0]["reason"]["capped_ratio"]}
    assert r.cfg.async_.max_staleness == 0
    assert sink.series("async/max_staleness")[:3] == [2, 1, 0]  # step 2 trained under eta 1


def test_an_automatic_knob_change_is_validated_like_a_persons(tmp_path):
    # the trainer's own change goes through the boundary: out of range -> rejected, not applied
    cfg = C.load("demo", BASE + ["async.enabled=true", "run.max_steps=2"])
    sink = MemorySink()
    with Runner(cfg, tmp_path, sink=sink, system_telemetry=False) as r:
        r.boundary.request({"async.max_staleness": 99}, reason={"rule": "test"})
        assert r.run() == "finished"
    rejected = [e for e in sink.events if e["kind"] == "knob_rejected"]
    assert len(rejected) == 1 and rejected[0]["requested_by"] == "auto"
    assert "async.max_staleness" in rejected[0]["errors"]
    assert r.cfg.async_.max_staleness == 2


@pytest.mark.timeout(180)  # the bug this guards against hung the resumed run forever
def test_resume_with_the_process_worker_continues_from_the_restored_version(tmp_path,
                                                                             monkeypatch):
    extra = ["async.enabled=true", "async.worker=process", "async.max_staleness=1",
             "run.checkpoint_every=3"]
    first, first_sink, _ = run(tmp_path, extra, steps=3)
    assert first.version == 3
    # the checkpoint holds the child's sampling RNG, moved on from the seed's (a resume
    # continues that stream instead of replaying the run's first samples)
    from trainer.run import checkpoint
    _, tensors = checkpoint.load(checkpoint.latest(tmp_path))
    fresh = torch.Generator().manual_seed(first.cfg.run.seed).get_state()
    assert tensors["rng"]["engine"].shape == fresh.shape
    assert not torch.equal(tensors["rng"]["engine"], fresh)
    # every token generated after the resume carries the restored version or a later one (a
    # child stamping version 0 made every new group too stale: all dropped, the run hung)
    new_versions = []
    real = GenerationWorker.handle

    def handle(self, finished):
        new_versions.extend(v for s in finished for v in s.versions[-s.segment_tokens:]
                            if s.segment_tokens)
        real(self, finished)

    monkeypatch.setattr(GenerationWorker, "handle", handle)
    again, sink, status = run(tmp_path, extra, steps=6, resume=True)
    assert status == "finished" and again.step == 6
    assert new_versions and min(new_versions) >= 3
    assert max(sink.series("async/staleness/max")) <= 1


def test_a_stall_stops_the_run_with_an_error_and_a_resumable_checkpoint(tmp_path, monkeypatch):
    from trainer.rollout.asynchronous import AsyncStall, admission
    from trainer.run import checkpoint

    real = admission.admission_allowed
    monkeypatch.setattr(admission, "admission_allowed",
                        lambda acc, run_, v, eta, b: v < 2 and real(acc, run_, v, eta, b))
    cfg = C.load("demo", BASE + ["async.enabled=true", "async.max_staleness=0", "run.max_steps=5"])
    sink = MemorySink()
    with Runner(cfg, tmp_path, sink=sink, system_telemetry=False) as r:
        with pytest.raises(AsyncStall):
            r.run()
    err = [e for e in sink.events if e["kind"] == "error"][-1]
    assert "accepted=" in err["message"] and "bound=" in err["message"]
    assert err["resumable_from_step"] == 2
    assert checkpoint.latest(tmp_path).name.endswith("2")
    assert not [t for t in threading.enumerate() if t.name == "rlpilot-generator"]


class OwnedLock:
    """A re-entrant lock that knows whether the calling thread holds it."""

    def __init__(self):
        self._lock, self._owner, self._depth = threading.RLock(), None, 0

    def __enter__(self):
        self._lock.acquire()
        self._owner, self._depth = threading.get_ident(), self._depth + 1

    def __exit__(self, *exc):
        self._depth -= 1
        if not self._depth:
            self._owner = None
        self._lock.release()

    def held(self) -> bool:
        return self._owner == threading.get_ident()


def test_greso_state_and_totals_change_only_under_the_shared_lock(tmp_path):
    # the generation worker reads GRESO's traces and p values (prompt selection) and adds
    # reward counts to the totals while the trainer updates them: every write holds the lock
    cfg = C.load("demo", BASE + ["async.enabled=true", "greso.enabled=true", "run.max_steps=4",
                                 "data.train_size=16"])
    unlocked = []
    with Runner(cfg, tmp_path, sink=MemorySink(), system_telemetry=False) as r:
        lock = OwnedLock()
        r.lock = r.rollout.worker.lock = r.selector.lock = lock

        def guard(name, fn):
            def call(*a, **kw):
                if not lock.held():
                    unlocked.append((name, threading.current_thread().name))
                return fn(*a, **kw)
            return call

        r.greso.record = guard("record", r.greso.record)
        r.greso.adapt_from_groups = guard("adapt", r.greso.adapt_from_groups)
        r.greso.decide = guard("decide", r.greso.decide)

        class Totals(dict):
            def __setitem__(self, k, v):
                if not lock.held():
                    unlocked.append(("totals." + k, threading.current_thread().name))
                super().__setitem__(k, v)

        r.totals = Totals(r.totals)
        assert r.run() == "finished"
        assert r.greso.trace(next(iter(r.greso._traces)))  # traces were written
    assert unlocked == []


def test_a_step_served_wholly_from_the_queue_reports_no_reward_rather_than_zero():
    """Right after a resume an asynchronous step may train only on groups queued before the stop:
    nothing was scored during it, so reward, length and zero-variance figures are absent (a gap
    on the charts), not 0; a step that scored groups reports them by hand-checkable means."""
    from trainer.engine.base import STOP as STOPPED
    from trainer.engine.base import EngineStats, Sample, SamplingParams
    from trainer.rollout.base import Group, RolloutResult, StepCounts, step_metrics
    from trainer.tasks.base import Problem

    cfg = C.load("async", ["rollout.n_samples_per_prompt=2"])
    params = SamplingParams(max_new_tokens=8)
    samples = [Sample([1], params, response_ids=[5] * n, logprobs=[0.0] * n, versions=[0] * n,
                      finish_reason=STOPPED) for n in (2, 4)]
    g = Group(problem=Problem(id="p", prompt="p", answer="a", kind="sum"), samples=samples, rewards=[1.0, 0.0],
              raw_scores=[1.0, 0.0])
    served = step_metrics(cfg, RolloutResult(groups=[g], scored=[], gen_seconds=0.0,
                                             counts=StepCounts()), EngineStats())
    for key in ("reward/mean", "reward/accuracy", "rollout/response_len/mean", "rollout/zero_var_ratio"):
        assert key not in served
    assert served["rollout/samples"] == 0 and "timing/gen_s" in served
    scored = step_metrics(cfg, RolloutResult(groups=[g], scored=[g], gen_seconds=0.0,
                                             counts=StepCounts()), EngineStats())
    assert scored["reward/mean"] == 0.5 and scored["reward/accuracy"] == 0.5
    assert scored["rollout/response_len/mean"] == 3.0 and scored["rollout/zero_var_ratio"] == 0.0


# --- stop and pause reach a step waiting for groups ---------------------------------------------

class Remote(ControlSource):
    """Commands sent from another thread at any moment, as the dashboard sends them."""

    def __init__(self):
        self.inbox, self.lock = [], threading.Lock()

    def send(self, kind, **kw):
        with self.lock:
            self.inbox.append(Command(kind, **kw))

    def poll(self):
        with self.lock:
            out, self.inbox = self.inbox, []
        return out


def _wedge(monkeypatch, extra_groups=2):
    """(eta 0) From version 1 on, admit nothing past B + `extra_groups` groups: step 2's collect
    takes the extra groups and waits for groups that cannot come (no deadlock alarm, no
    timeout within the test: only a stop or pause gets it out)."""
    from trainer.rollout.asynchronous import admission, collect

    real = admission.admission_allowed
    gate = {"open": False}

    def admit(acc, running, v, eta, b):
        if not gate["open"] and v >= 1 and acc + running + 1 > b + extra_groups:
            return False
        return real(acc, running, v, eta, b)

    monkeypatch.setattr(admission, "admission_allowed", admit)
    monkeypatch.setattr(collect, "DEADLOCK_GRACE_S", 600.0)
    return gate


def _start(cfg, run_dir, controls):
    """A runner running in a thread; returns (runner, thread, outcome list)."""
    r = Runner(cfg, run_dir, sink=MemorySink(), controls=controls, system_telemetry=False)
    out = []

    def go():
        try:
            out.append(r.run())
        except BaseException as e:  # surfaced by the test
            out.append(e)
    t = threading.Thread(target=go, name="test-runner")
    t.start()
    return r, t, out


def _wait_wedged(r, seconds=1.5):
    """Until step 1 is done and the trainer has waited `seconds` in step 2's collect."""
    import time

    deadline = time.monotonic() + 120
    while r.step < 1 or r.rollout.state.queue or r.rollout.state.running:
        assert time.monotonic() < deadline, "the run never reached the wedged collect"
        time.sleep(0.05)
    time.sleep(seconds)
    assert r.step == 1  # guard: still waiting for groups


def _checkpoint_groups(run_dir):
    from trainer.rollout.april import PartialBuffer
    from trainer.run import checkpoint

    state, tensors = checkpoint.load(checkpoint.latest(run_dir))
    buf = PartialBuffer()
    buf.load_state_dict({"groups": tensors["rollout"]["groups"]})
    return state, tensors["rollout"], buf.groups


@pytest.mark.timeout(240)
@pytest.mark.parametrize("worker", ["thread", "process"])
def test_stop_reaches_a_step_waiting_for_groups_that_cannot_come(tmp_path, monkeypatch, worker):
    import time

    _wedge(monkeypatch)
    extra = ["async.enabled=true", f"async.worker={worker}", "async.max_staleness=0",
             "run.max_steps=50"]
    remote = Remote()
    r, t, out = _start(C.load("demo", BASE + extra), tmp_path, remote)
    with r:
        _wait_wedged(r)
        t0 = time.monotonic()
        remote.send(STOP)
        t.join(timeout=30)
        latency = time.monotonic() - t0
        assert out == ["stopped"] and latency < 5, (out, latency)
    assert r.step == 1
    kinds = [e["kind"] for e in r.sink.events]
    assert kinds[-3:] == ["stop_requested", "checkpoint", "run_stopped"]
    # the two groups the waiting step had taken went back to the queue, and into the checkpoint
    state, rollout, groups = _checkpoint_groups(tmp_path)
    assert state["step"] == 1 and rollout["queued"] == 2
    assert len([g for g in groups if g.complete]) == 2
    assert not [x for x in threading.enumerate() if x.name == "rlpilot-generator"]
    if worker == "process":
        assert r.engine.processes and all(p.poll() is not None for p in r.engine.processes)

    # resumed (nothing wedged now): the queued groups are trained first, at step 2
    monkeypatch.undo()
    trained = []
    real = AsyncDriver.collect

    def collect(self, cfg, version):
        res = real(self, cfg, version)
        trained.append([g.draw for g in res.groups])
        return res

    monkeypatch.setattr(AsyncDriver, "collect", collect)
    again, sink, status = run(tmp_path, extra[:-1], steps=3, resume=True)
    assert status == "finished" and again.step == 3
    assert {g.draw for g in groups} <= set(trained[0])


@pytest.mark.timeout(240)
def test_pause_while_waiting_for_groups_then_resume_continues(tmp_path, monkeypatch):
    import time

    gate = _wedge(monkeypatch)
    remote = Remote()
    cfg = C.load("demo", BASE + ["async.enabled=true", "async.max_staleness=0", "run.max_steps=4"])
    r, t, out = _start(cfg, tmp_path, remote)
    with r:
        _wait_wedged(r)
        t0 = time.monotonic()
        remote.send(PAUSE)
        while "paused" not in [e["kind"] for e in r.sink.events]:
            assert time.monotonic() - t0 < 5, "the pause did not reach the waiting step"
            time.sleep(0.05)
        assert r.rollout.worker.paused and r.step == 1
        gate["open"] = True  # what a person might change while paused; then resume
        remote.send(RESUME)
        t.join(timeout=120)
        assert out == ["finished"] and r.step == 4
    paused = [e for e in r.sink.events if e["kind"] in ("paused", "resumed")]
    assert [(e["kind"], e["step"]) for e in paused] == [("paused", 1), ("resumed", 1)]
    assert sum(r.sink.series("rollout/trained_tokens")) > 0


# --- the token ledger of an asynchronous run ------------------------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("worker", ["thread", "process"])
def test_every_generated_token_is_trained_dropped_or_held_in_the_checkpoint(tmp_path, worker):
    """Dynamic sampling drops zero-variance groups; eta lowered from 2 to 0 at step 3 makes the
    queued groups stale (raised again at step 4, so the worker runs ahead). Stopped at step 6
    (with groups in flight): the checkpoint's ledger
    equals trained + dropped + the tokens of the groups it holds; at every step generated >=
    trained + dropped."""
    from trainer.rollout.april import PartialBuffer
    from trainer.run.controls import SET_KNOBS

    cfg = C.load("demo", BASE + ["async.enabled=true", f"async.worker={worker}",
                                 "async.max_staleness=2", "rollout.dynamic_sampling=true",
                                 "run.max_steps=50"])
    ref, sink = [], MemorySink()
    plan = {3: Command(SET_KNOBS, knobs={"async.max_staleness": 0}),
            4: Command(SET_KNOBS, knobs={"async.max_staleness": 2}), 6: Command(STOP)}
    with Runner(cfg, tmp_path, sink=sink, controls=AtStep(ref, plan),
                system_telemetry=False) as r:
        ref.append(r)
        assert r.run() == "stopped" and r.step == 6
    assert min(sink.series("rollout/tokens/waiting")) >= 0   # generated >= trained + dropped
    state, rollout, groups = _checkpoint_groups(tmp_path)
    ledger = state["ledger"]
    assert ledger["dropped"]["stale"] > 0 and ledger["dropped"]["zero_variance"] > 0  # guards
    assert any(not g.complete for g in groups)  # guard: groups were in flight at the stop
    held = PartialBuffer()
    for g in groups:
        held.put(g)
    assert ledger["generated"] == (ledger["trained"] + sum(ledger["dropped"].values())
                                   + held.tokens())
    assert ledger["trained"] == sum(sink.series("rollout/trained_tokens"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("state", ["waiting", "training", "evaluating", "checkpointing"])
def test_stop_latency_in_each_state(tmp_path, monkeypatch, state):
    """A stop sent while the run waits for groups, trains, evaluates or saves a checkpoint ends
    it (checkpoint saved, engine process gone) within seconds: printed with -s."""
    import time

    from trainer.algo import learner
    from trainer.run import runner as runner_mod
    from trainer.run import state as run_state

    remote, sent, ref = Remote(), [], []

    def stop_on_entry(owner, name, at_step):
        real = getattr(owner, name)

        def wrapped(*a, **k):
            if not sent and ref and ref[0].step >= at_step:
                remote.send(STOP)
                sent.append(time.monotonic())
            return real(*a, **k)
        monkeypatch.setattr(owner, name, wrapped)

    extra = ["async.enabled=true", "async.worker=process", "async.max_staleness=0",
             "run.max_steps=50", "run.eval_size=16"]
    if state == "waiting":
        _wedge(monkeypatch)
    elif state == "training":
        stop_on_entry(learner.Learner, "train", 1)
    elif state == "evaluating":
        extra.append("run.eval_every=2")
        stop_on_entry(runner_mod, "evaluate", 1)
    else:
        extra.append("run.checkpoint_every=2")
        stop_on_entry(run_state, "save", 1)
    r, t, out = _start(C.load("demo", BASE + extra), tmp_path, remote)
    ref.append(r)
    with r:
        if state == "waiting":
            _wait_wedged(r)
            remote.send(STOP)
            sent.append(time.monotonic())
        t.join(timeout=120)
        assert sent, out
        latency = time.monotonic() - sent[0]
    print(f"\nstop latency while {state}: {latency:.2f} s (stopped at step {r.step})")
    assert out == ["stopped"] and latency < 10
    assert r.engine.processes and all(p.poll() is not None for p in r.engine.processes)


def test_no_knob_value_puts_more_samples_in_flight_than_four_rounds_of_the_engines_slots(
        tmp_path, monkeypatch):
    # max_inflight 3889 with eta 64 (both inside their ranges) would admit (64 + 1) x B groups at
    # once; the worker caps the samples generating at 4 x rollout.max_slots (16 x 4 / G 4 = 16
    # groups), so a group never waits behind thousands of others
    seen = _instrument(monkeypatch)
    running = []
    real = GenerationWorker.launch

    def launch(self, g, samples):
        real(self, g, samples)
        running.append(len(self.state.running))

    monkeypatch.setattr(GenerationWorker, "launch", launch)
    r, sink, status = run(tmp_path, ["async.enabled=true", "async.max_inflight=3889",
                                     "async.max_staleness=64"], steps=3)
    assert status == "finished" and r.step == 3
    assert seen and max(running) == 16  # reached the cap (guard), never more
    assert max(sink.series("async/running_groups")) <= 16


def test_dynamic_sampling_that_finds_no_signal_lets_groups_through_and_says_so_once(tmp_path):
    # top_p 0.01 (its least): every answer of a group alike, so every group is zero-variance
    r, sink, status = run(tmp_path, ["async.enabled=true", "rollout.dynamic_sampling=true",
                                     "rollout.top_p=0.01", "rollout.max_sampling_rounds=1"])
    assert status == "finished" and r.step == 3
    warnings = [e for e in sink.events if e["kind"] == "warning"
                and "dynamic sampling found no group" in e["message"]]
    assert len(warnings) == 1 and "6 in a row" in warnings[0]["message"]   # 1 round x B = 6
    assert sum(sink.series("rollout/trained_tokens")) == 0        # nothing with signal to train
    assert sum(sink.series("rollout/waste/zero_variance")) > 0    # and the ledger says where it went
