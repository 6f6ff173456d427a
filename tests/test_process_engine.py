"""The embedded engine in its own process behaves like the in-process one."""
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch

from trainer.engine.base import ABORT, Sample, SamplingParams
from trainer.engine.embedded import EmbeddedEngine
from trainer.engine.process import ProcessEngine
from trainer.models.loading import load_model, load_tokenizer


@pytest.fixture(scope="module")
def parts():
    model = load_model("builtin", torch.device("cpu"), torch.float32).eval()
    return model, load_tokenizer("builtin")


def _samples(tok, params):
    texts = ["[3,5]=", "[" + ",".join(["7"] * 16) + "]=", "[9]=", "[1,2,3,4,5,6]="]
    return [Sample(tok(t).input_ids, params) for t in texts]


def test_same_tokens_logprobs_and_versions_as_in_process(parts):
    model, tok = parts
    params = SamplingParams(temperature=1.0, max_new_tokens=120)
    ref = _samples(tok, params)
    EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=3, max_seq_len=200,
                   seed=4).generate(ref)
    eng = ProcessEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=3, max_seq_len=200,
                        seed=4)
    try:
        got = _samples(tok, params)
        eng.generate(got)
        assert [s.response_ids for s in got] == [s.response_ids for s in ref]
        for a, b in zip(got, ref):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6)
        assert eng.stats.generated_tokens == sum(len(s.response_ids) for s in got)
    finally:
        eng.close()


def test_abort_resume_and_weight_versions_across_the_process_boundary(parts):
    model, tok = parts
    greedy = SamplingParams(temperature=0.0, max_new_tokens=150)
    eng = ProcessEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=4, max_seq_len=200)
    pid = eng.proc.pid
    try:
        ss = _samples(tok, greedy)
        eng.submit(ss)
        while sum(len(s.response_ids) for s in ss) < 20:
            eng.step()
        parts_ = eng.abort(keep_cache=True)
        unfinished = [s for s in ss if not s.done]
        assert {s.request_id for s in parts_} >= {s.request_id for s in unfinished}
        assert all(s.finish_reason == ABORT for s in parts_) and eng.num_pending == 0
        prefix = {s.request_id: list(s.response_ids) for s in unfinished}
        eng.update_weights(model.state_dict(), version=3)
        eng.generate(unfinished)
        for s in unfinished:
            s.check()
            n = len(prefix[s.request_id])
            assert s.response_ids[:n] == prefix[s.request_id]
            assert set(s.versions[:n]) <= {0} and set(s.versions[n:]) == {3}
    finally:
        eng.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_result_filed_while_waiting_for_another_reply_stays_pending(parts):
    """The child's "finished" message can arrive while the parent waits for an abort's or new
    weights' reply; that sample is then no longer live but not yet returned by step(). It must
    still count as pending: the asynchronous worker steps the engine only while something is
    pending, so a sample left uncounted was never handed out and the run waited for it."""
    model, tok = parts
    eng = ProcessEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=2, max_seq_len=200)
    try:
        s = Sample(tok("[3,5]=").input_ids, SamplingParams(temperature=0.0, max_new_tokens=2))
        eng.submit([s])
        deadline = time.monotonic() + 30
        while not eng._done and time.monotonic() < deadline:   # as abort/weights do: wait for a
            time.sleep(0.1)                                    # reply, filing what comes first
            eng.generator.get_state()
        assert eng._done == [s] and not eng.live
        assert eng.num_pending == 1
        assert eng.step() == [s] and s.done and len(s.response_ids) == 2
        assert eng.num_pending == 0
    finally:
        eng.close()


def test_child_decodes_on_the_parents_device_and_leaves_no_file(parts, tmp_path):
    model, tok = parts
    eng = ProcessEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=2, max_seq_len=200)
    try:
        assert eng.child_info["device"] == str(next(model.parameters()).device) == "cpu"
        assert eng.child_info["dtype"] == "torch.float32"
        assert eng.child_info["pid"] == eng.proc.pid
        # the shared weights file is unlinked once both sides mapped it
        assert not Path(eng.weights.path).exists()
    finally:
        eng.close()


def test_restored_version_reaches_the_child(parts):
    # a resumed run sets engine.version; tokens generated afterwards must carry it
    model, tok = parts
    eng = ProcessEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=2, max_seq_len=200)
    try:
        eng.version = 7
        ss = _samples(tok, SamplingParams(temperature=1.0, max_new_tokens=20))
        eng.generate(ss)
        assert {v for s in ss for v in s.versions} == {7}
    finally:
        eng.close()


def test_the_childs_sampling_rng_is_saved_and_restored(parts):
    """A checkpoint's engine RNG state, taken from the child, continues the child's stream: the
    same samples after set_state, and the in-process engine's stream under the same seed."""
    model, tok = parts
    params = SamplingParams(temperature=1.0, max_new_tokens=40)
    eng = ProcessEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=4, max_seq_len=200, seed=3)
    local = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=4, max_seq_len=200, seed=3)
    try:
        eng.generate(_samples(tok, params))      # move the stream away from the seed
        local.generate(_samples(tok, params))
        state = eng.generator.get_state()
        assert torch.equal(state, local.generator.get_state())
        first = _samples(tok, params)
        eng.generate(first)
        eng.generator.set_state(state)
        again = _samples(tok, params)
        eng.generate(again)
        assert [s.response_ids for s in again] == [s.response_ids for s in first]
        eng.generator.manual_seed(3)             # what data parallelism does per rank
        assert torch.equal(eng.generator.get_state(), torch.Generator().manual_seed(3).get_state())
    finally:
        eng.close()


def _engine_in_daemon(report, hold: bool):
    """Runs in a daemonic process, as a Celery prefork child does."""
    model = load_model("builtin", torch.device("cpu"), torch.float32).eval()
    tok = load_tokenizer("builtin")
    eng = ProcessEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=2, max_seq_len=200)
    ss = _samples(tok, SamplingParams(temperature=0.0, max_new_tokens=20))
    eng.generate(ss)
    report.put((eng.proc.pid, sum(len(s.response_ids) for s in ss)))
    if hold:
        time.sleep(120)  # killed by the test meanwhile
    eng.close()


@pytest.mark.parametrize("kill", [False, True], ids=["close", "sigkill-parent"])
def test_starts_from_a_daemonic_process_and_dies_with_it(kill):
    ctx = mp.get_context("spawn")
    report = ctx.Queue()
    parent = ctx.Process(target=_engine_in_daemon, args=(report, kill), daemon=True)
    parent.start()
    try:
        child_pid, tokens = report.get(timeout=120)
        assert tokens > 0
        if kill:
            os.kill(parent.pid, signal.SIGKILL)
        parent.join(timeout=30)
        # the engine child notices its socket closed and exits
        deadline = time.monotonic() + 10
        while psutil.pid_exists(child_pid) and time.monotonic() < deadline:
            if psutil.Process(child_pid).status() == psutil.STATUS_ZOMBIE:
                break
            time.sleep(0.1)
        assert (not psutil.pid_exists(child_pid)
                or psutil.Process(child_pid).status() == psutil.STATUS_ZOMBIE), "engine child left"
    finally:
        if parent.is_alive():
            parent.kill()
