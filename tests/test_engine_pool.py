"""Several generation processes behind one engine (trainer/engine/pool.py): balanced by
outstanding tokens, every member at the policy it was given, and a member SIGKILLed mid-run
costs no sample and no step."""
import os
import signal
import time

import psutil
import pytest
import torch
from helpers import TINY_RUN, full_forward_logprobs, new_weights

from trainer import config as C
from trainer.engine.base import SEGMENT, Sample, SamplingParams
from trainer.engine.pool import EnginePool, GenerationGaveUp
from trainer.engine.process import ProcessEngine
from trainer.models.loading import load_model, load_tokenizer
from trainer.observe.metrics import MemorySink
from trainer.rollout.ledger import REASONS
from trainer.run.runner import Runner

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def parts():
    model = load_model("builtin", torch.device("cpu"), torch.float32).eval()
    return model, load_tokenizer("builtin")


def make_pool(model, size, eos=(), slots=4, **kw):
    def member(index, seed, weights):
        return ProcessEngine(model, eos_token_ids=list(eos), max_slots=slots, max_seq_len=240,
                             seed=seed, weights=weights)
    return EnginePool(member, size, backoff_s=0.1, **kw)


def prompt(tok, text="[3,5,7,1]="):
    return tok(text).input_ids


def drain(pool, deadline_s=120):
    out, t0 = [], time.monotonic()
    while pool.num_pending:
        out += pool.step()
        assert time.monotonic() - t0 < deadline_s, "the pool stopped making progress"
    return out


def wait_until(cond, pool=None, deadline_s=60):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < deadline_s
        if pool is not None:
            pool.step()
        time.sleep(0.02)


def gone(pid):
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def check_closed(pool):
    """Every child the pool ever started has exited (ps), none left behind."""
    pids = [p.pid for p in pool.processes]
    assert pids
    assert all(p.poll() is not None for p in pool.processes)
    assert all(gone(pid) for pid in pids)


def test_each_sample_goes_to_the_member_with_the_least_outstanding_tokens(parts):
    model, tok = parts
    pool = make_pool(model, 2, eos=[tok.eos_token_id])
    try:
        budgets = [100, 10, 10, 10, 60, 40]
        ss = [Sample(prompt(tok), SamplingParams(max_new_tokens=n)) for n in budgets]
        # one at a time: each goes where the fewest tokens are still to come
        where = []
        for s in ss:
            pool.submit([s])
            where.append(next(m.index for m in pool.members if s.request_id in m.held))
        # 100 -> 0 (tie: lower index); 10, 10, 10 -> 1 (10, 20, 30 < 100); 60 -> 1 (30 < 100,
        # then 90); 40 -> 1 (90 < 100)
        assert where == [0, 1, 1, 1, 1, 1]
        assert [m.load for m in pool.members] == [100, 130]
        # a segment limit caps what a submission may generate: that is its budget
        seg = Sample(prompt(tok), SamplingParams(max_new_tokens=200, segment_max_tokens=8))
        pool.submit([seg])
        assert seg.request_id in pool.members[0].held and pool.members[0].load == 108
        done = drain(pool)
        assert sorted(s.request_id for s in done) == sorted(s.request_id for s in ss + [seg])
        assert [m.load for m in pool.members] == [0, 0]
        assert all(m.engine.stats.decode_steps > 0 for m in pool.members)  # both generated
        assert pool.stats.generated_tokens == sum(len(s.response_ids) for s in done)
        assert pool.stats.decode_steps == sum(m.engine.stats.decode_steps for m in pool.members)
    finally:
        pool.close()
    check_closed(pool)


def test_after_an_update_every_member_samples_from_the_new_weights(parts):
    model, tok = parts
    pool = make_pool(model, 2)
    try:
        other = new_weights(model)
        pool.update_weights(other.state_dict(), version=1)
        buffer_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        assert pool.last_sync_bytes == 2 * buffer_bytes       # one copy per generation process
        ss = [Sample(prompt(tok, t), SamplingParams(max_new_tokens=30))
              for t in ("[3,5]=", "[9,9,1]=", "[4]=", "[2,2,2,2]=")]
        pool.submit(ss)
        holders = {m.index: [s for s in ss if s.request_id in m.held] for m in pool.members}
        assert all(len(v) == 2 for v in holders.values())   # guard: both members hold work
        drain(pool)
        for s in ss:
            s.check()
            assert len(s.response_ids) == 30 and set(s.versions) == {1}
            ref = full_forward_logprobs(other, s)
            assert torch.allclose(torch.tensor(s.logprobs), ref, atol=1e-4)
            # guard: the old weights would not pass
            assert not torch.allclose(torch.tensor(s.logprobs), full_forward_logprobs(model, s),
                                      atol=1e-4)
    finally:
        pool.close()
    check_closed(pool)


def test_a_member_killed_mid_generation_loses_no_sample_and_comes_back(parts):
    model, tok = parts
    pool = make_pool(model, 2, slots=2)
    try:
        # partial samples: 10 tokens of version 0 each, then the rest under version 1
        ss = [Sample(prompt(tok), SamplingParams(max_new_tokens=120, segment_max_tokens=10))
              for _ in range(12)]
        pool.generate(ss)
        assert all(s.finish_reason == SEGMENT and len(s.response_ids) == 10 for s in ss)
        prefix = {s.request_id: (list(s.response_ids), list(s.logprobs)) for s in ss}
        newer = new_weights(model)
        # recompute_kv: the parked prefixes are prefilled again under the new weights, on
        # whichever process continues them, so every later token matches a plain forward pass
        pool.update_weights(newer.state_dict(), version=1, recompute_kv=True)
        for s in ss:
            s.params = SamplingParams(max_new_tokens=120)
        pool.submit(ss)
        victim = pool.members[1]
        pid = victim.engine.proc.pid
        mine, before = set(victim.held), victim.delivered
        done = []
        # kill it once it has returned a sample and still holds others (so it is mid-way)
        while not (victim.delivered > before and len(victim.held) >= 2):
            done += pool.step()
        os.kill(pid, signal.SIGKILL)
        unfinished = set(victim.held)
        while not any("died" in w for w in pool.warnings):
            done += pool.step()
        # at once (its restart is not even scheduled yet): what it held went to the survivor
        assert victim.engine is None and not pool._queue
        assert unfinished <= (set(pool.members[0].held) | {s.request_id for s in done}
                              | {s.request_id for s in pool._ready})  # returned, not handed out
        done += drain(pool)
        ids = [s.request_id for s in done]
        assert len(ids) == len(set(ids)) == len(ss)            # each sample exactly once
        assert set(ids) == {s.request_id for s in ss}
        for s in ss:
            s.check()
            ids0, logprobs0 = prefix[s.request_id]
            # the tokens from before are kept exactly, with their versions; the rest is version 1
            assert s.response_ids[:10] == ids0 and s.logprobs[:10] == logprobs0
            assert s.versions == [0] * 10 + [1] * 110
            # float32 over 120 incremental decode steps: a rare token's logprob (around -10)
            # drifts by a relative 1e-5, over atol alone (CI saw it under load)
            torch.testing.assert_close(torch.tensor(s.logprobs[10:]), full_forward_logprobs(newer, s)[10:],
                                       rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(torch.tensor(s.logprobs[:10]), full_forward_logprobs(model, s)[:10],
                                       rtol=1e-4, atol=1e-4)
        warnings = pool.take_warnings()
        died = [w for w in warnings if w.startswith(f"generation process 1 (pid {pid}) died")]
        assert len(died) == 1 and "SIGKILL" in died[0], warnings
        resubmitted = int(died[0].split("; ")[1].split()[0])
        assert 0 < resubmitted < len(mine)                    # guard: some had come back first
        # the generated-token count never went down, and counts what reached the parent
        assert pool.stats.generated_tokens == 12 * 120

        # restarted with a new pid, given work again, at the current weights
        wait_until(lambda: pool.generators_alive == 2, pool)
        new_pid = pool.pids()[1]
        assert new_pid != pid and gone(pid)
        assert any(w.startswith(f"generation process 1 restarted (pid {new_pid})")
                   for w in warnings + pool.take_warnings())
        other = new_weights(model, 0.95)
        pool.update_weights(other.state_dict(), version=2)
        again = [Sample(prompt(tok, "[6,1]="), SamplingParams(max_new_tokens=20)) for _ in range(2)]
        pool.submit(again)
        assert any(s.request_id in pool.members[1].held for s in again)
        drain(pool)
        for s in again:
            assert set(s.versions) == {2}
            assert torch.allclose(torch.tensor(s.logprobs), full_forward_logprobs(other, s),
                                  atol=1e-4)
    finally:
        pool.close()
    check_closed(pool)


def test_with_every_member_down_the_pool_pauses_then_continues(parts):
    model, tok = parts
    pool = make_pool(model, 1)
    try:
        ss = [Sample(prompt(tok), SamplingParams(max_new_tokens=60)) for _ in range(4)]
        pool.submit(ss)
        pid = pool.pids()[0]
        os.kill(pid, signal.SIGKILL)
        paused_calls = 0
        while pool.num_pending:
            if not pool.generators_alive:
                paused_calls += 1
            pool.step()
        assert all(len(s.response_ids) == 60 for s in ss)
        warnings = pool.take_warnings()
        assert any("died" in w for w in warnings)
        assert any(w.startswith("generation paused") for w in warnings)
        assert 0 < paused_calls < 1000  # it paused, and waited there instead of spinning hot
        assert pool.pids()[0] != pid
    finally:
        pool.close()
    check_closed(pool)


def test_a_member_that_cannot_restart_is_given_up_with_the_reason(parts):
    model, tok = parts
    starts = []

    def member(index, seed, weights):
        starts.append(index)
        if len(starts) > 1:
            raise RuntimeError("no device left")
        return ProcessEngine(model, eos_token_ids=[], max_slots=2, max_seq_len=240, seed=seed)

    pool = EnginePool(member, 1, backoff_s=0.01, backoff_max_s=0.02, max_failures=3)
    try:
        pool.submit([Sample(prompt(tok), SamplingParams(max_new_tokens=40))])
        os.kill(pool.pids()[0], signal.SIGKILL)
        with pytest.raises(Exception) as err:
            drain(pool, deadline_s=60)
        assert isinstance(err.value, GenerationGaveUp)
        assert str(err.value) == (
            f"generation process 0 (pid {pool.members[0].pid}, 2 restarts) could not be "
            "restarted (RuntimeError: no device left) and was given up: 3 failures in a row "
            "(deaths before it delivered a token, or failed restarts) give a generation process "
            "up, and none is left")
    finally:
        pool.close()
    check_closed(pool)


def test_each_generation_process_gets_a_gpu_of_its_own_when_there_are_enough(monkeypatch):
    from trainer.engine import generation_device

    cuda = torch.device("cuda", 0)
    # two machines, two training ranks on each (cuda:0 and cuda:1 here): this machine's count
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [generation_device(cuda, i, 2) for i in range(2)] == [torch.device("cuda", 2),
                                                                  torch.device("cuda", 3)]
    # three would not fit: every one shares the trainer's device
    assert {generation_device(cuda, i, 3) for i in range(3)} == {cuda}
    assert generation_device(torch.device("cpu"), 1, 2) == torch.device("cpu")


# --- whole runs ---------------------------------------------------------------------------------

def _kill_during_step_2(monkeypatch, ref, member_index):
    """SIGKILL generation process `member_index` the first time the engine steps in step 2
    with that member busy; returns the list the pid goes into."""
    killed = []
    real = EnginePool.step

    def step(self):
        r = ref[0] if ref else None
        m = self.members[member_index]
        if r is not None and r.step == 1 and not killed and m.engine is not None and m.held:
            killed.append(m.engine.proc.pid)
            os.kill(killed[0], signal.SIGKILL)
        return real(self)

    monkeypatch.setattr(EnginePool, "step", step)
    return killed


def _check_ledger(rows):
    waiting = 0
    for r in rows:
        assert r["rollout/waste/total"] == sum(r[f"rollout/waste/{x}"] for x in REASONS)
        assert r["rollout/tokens/generated"] == (r["rollout/tokens/trained"]
                                                 + r["rollout/waste/total"]
                                                 + r["rollout/tokens/waiting"] - waiting)
        waiting = r["rollout/tokens/waiting"]
    return waiting


@pytest.mark.slow
@pytest.mark.parametrize("preset,procs", [("async", 2), ("april", 1), ("demo", 2)])
def test_a_run_survives_a_generation_process_killed_mid_step(tmp_path, monkeypatch, preset, procs):
    cfg = C.load(preset, [*TINY_RUN, "rollout.max_response_len=48", "run.max_steps=4",
                          f"cluster.gen_procs={procs}", "async.max_inflight=8",
                          "april.over_sampling_batch_size=8", "april.segment_max_tokens=16"])
    sink, ref = MemorySink(), []
    killed = _kill_during_step_2(monkeypatch, ref, procs - 1)
    with Runner(cfg, tmp_path, sink=sink, system_telemetry=False) as r:
        ref.append(r)
        pool = r.engine
        assert isinstance(getattr(pool, "engine", pool), EnginePool) and len(pool.members) == procs
        assert r.run() == "finished" and r.step == 4
        held = r.rollout.held_tokens()
        rollout_tokens = r.engine.stats.generated_tokens - r.eval_tokens
        ledger = r.rollout.ledger
        # restarted (a short run may end first: wait for it) and used again at the run's policy
        wait_until(lambda: pool.generators_alive == procs, pool)
        assert pool.pids()[procs - 1] != killed[0]
        probe = [Sample(prompt(r.tokenizer), SamplingParams(max_new_tokens=8))
                 for _ in range(procs)]
        pool.submit(probe)
        assert any(s.request_id in pool.members[procs - 1].held for s in probe)
        drain(pool)
        assert {v for s in probe for v in s.versions} == {r.version} and r.version == 4
    assert killed, "guard: the process was killed"
    warnings = [e["message"] for e in sink.events if e["kind"] == "warning"]
    died = [w for w in warnings if f"generation process {procs - 1} (pid {killed[0]}) died" in w]
    assert len(died) == 1, warnings
    if procs == 1:
        assert any(w.startswith("generation paused") for w in warnings)
    rows = [x for x in sink.steps if "rollout/tokens/generated" in x]
    assert [x["step"] for x in rows] == [1, 2, 3, 4]
    waiting = _check_ledger(rows)
    assert all(x["engine/generators_alive"] <= procs for x in rows)
    assert all(x["perf/weight_sync_bytes"] > 0 for x in rows if x["engine/generators_alive"])
    assert ledger.generated == rollout_tokens
    assert ledger.generated == ledger.trained + ledger.waiting + sum(ledger.dropped.values())
    if preset != "async":
        assert waiting == held            # nothing left in the engine at a synchronous boundary
    assert sum(x["rollout/tokens/trained"] for x in rows) > 0   # guard: it trained
    check_closed(getattr(pool, "engine", pool))
