"""rlpilot's SGLang engine against a REAL SGLang server (the one `make sglang` installs in
.venv-sglang; on a CPU, SGLang's CPU engine) serving SmolLM2-135M-Instruct in float32:
log-probabilities equal the trainer's forward pass, greedy outputs equal Hugging Face's, abort +
resume loses and repeats nothing, weight updates tag tokens with the server's own versions,
an APRIL run and an asynchronous run, two servers and one killed mid-run, and the
training–inference mismatch of a float32 and of a bfloat16 server (rollout.dtype).

One float32 server for the session (20-60 s to start; real_sglang_server in tests/conftest.py,
shared with the dashboard's test, tests/web/test_web_sglang.py; a test that changes its weights
puts the model's own back); a fresh one only where the proof is about starting, flags or
killing: the two-server test has a second one (started in the background ahead of it,
tests/conftest.py) and kills it, and a bfloat16 server started by
a child process serves the bfloat16 test, then the start-up-and-kill test SIGKILLs that child.
Skipped only when .venv-sglang is absent (`make sglang`; `make test` builds it). Servers run
with OMP_NUM_THREADS=1; the module's own are stopped when it ends, the shared one when the
session does.

Merged to halve the module's time; what each proved and where it is proven now:
- test_a_float32_server_and_the_trainer_agree_to_rounding (a 2-step float32 run): its figures and
  its explicit rollout.dtype=float32 are checked on the LoRA run (2 steps, the same server, the
  same band): test_a_lora_run_sends_the_server_its_merged_weights.
- test_multi_turn_episodes_generate_each_turn_on_the_server[sync]: the server generating each
  turn and the environment's tokens sent back as context are proven by the [all] run (the same
  episode engine over the same client; APRIL's segments and the asynchronous worker on top); the
  synchronous driver with episodes, by tests/test_episode_runs.py (embedded engine and pool).
- the start-up-and-kill test started a float32 server of its own in a child process; it now
  kills the child that started the bfloat16 test's server (a server, its flags and its group
  guard are the same whatever the dtype).
"""
import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
import torch
from helpers import full_forward_logprobs

from trainer import config as C
from trainer.engine.base import ABORT, LENGTH, STOP, EngineError, Sample, SamplingParams
from trainer.engine.sglang import SGLangEngine
from trainer.engine.sglang.server import VENV, SGLangServer
from trainer.models.loading import load_model, load_tokenizer, stop_token_ids
from trainer.observe.metrics import MemorySink
from trainer.run.controls import SET_KNOBS, Command, ControlSource

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (VENV / "bin" / "python").is_file(),
                                 reason=f"no SGLang virtualenv at {VENV}: run `make sglang`")]

QUESTIONS = ["What is 12 + 7?", "Name three colours.", "Write a haiku about the sea.",
             "Count from one to ten in words."]
RUN = ["rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
       "rollout.max_response_len=24", "rollout.max_slots=8", "algo.skip_zero_adv=false",
       "run.reward_workers=0", "model.threads=1", "run.eval_every=0", "run.checkpoint_every=0",
       "data.system_prompt=Solve it.", "rollout.engine=sglang"]


@pytest.fixture(scope="module")
def model_dir(smollm2_dir):
    return smollm2_dir


@pytest.fixture(scope="module")
def server(real_sglang_server):
    """The session's float32 server (tests/conftest.py), shared with the dashboard's SGLang test."""
    return real_sglang_server


@pytest.fixture(scope="module")
def policy(model_dir):
    torch.set_num_threads(1)
    model = load_model(str(model_dir), torch.device("cpu"), torch.float32).eval()
    return model, load_tokenizer(str(model_dir))


@pytest.fixture
def original_weights_after(sglang_original_weights_after):
    """The model's own weights back on the shared server after the test (tests/conftest.py)."""


@pytest.fixture
def engines(policy):
    made = []

    def make(urls, **kw):
        model, tok = policy
        eng = SGLangEngine(urls, eos_token_ids=stop_token_ids(model, tok),
                           model_config=model.config, **kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


class _HeldMidAnswer:
    """Forces what the abort and weight-update tests need -- answers cut mid-generation --
    instead of hoping a sleep or the trainer's pace lands the cut while the server decodes.

    `freeze()` waits until the server reports a request past its prefill (GET /v1/loads
    num_running_reqs: it holds its first token), then pauses the server in place
    (/pause_generation mode "in_place": running requests keep their state and generate nothing
    more), so no answer can finish before the cut. The engine's next cut -- the
    /pause_generation of update_weights(), or the /abort_request of abort() -- is then sent
    while frozen (the server marks each running request aborted; it stops after one more
    token, keeping what it generated) and only then does the server continue. Without this the
    guards ("...: the test proves nothing") fail on a busy machine, where the answers may
    all finish (or not start) before the update or the abort comes."""

    def __init__(self, monkeypatch, url):
        self.url, self.frozen, self.cuts = url, False, 0
        real_control, real_aborts = SGLangEngine._control, SGLangEngine._send_aborts

        def control(engine, srv, method, path, body=None):
            if path == "/pause_generation" and self.frozen:
                self._post("/abort_request", {"abort_all": True})   # marked while frozen
                self.thaw()
            return real_control(engine, srv, method, path, body)

        def send_aborts(engine, tickets, abort_all):
            real_aborts(engine, tickets, abort_all)   # marked while frozen
            self.thaw()

        monkeypatch.setattr(SGLangEngine, "_control", control)
        monkeypatch.setattr(SGLangEngine, "_send_aborts", send_aborts)

    def _post(self, path, body):
        requests.post(self.url + path, json=body, timeout=60).raise_for_status()

    def _running(self) -> bool:
        loads = requests.get(self.url + "/v1/loads", timeout=10).json()["loads"]
        return any(x["num_running_reqs"] > 0 for x in loads)

    def freeze(self, can_run=lambda: True, timeout_s=120.0) -> bool:
        """Freeze the server with an answer mid-generation; False when none came (can_run()
        said nothing could, or timeout_s passed)."""
        deadline = time.monotonic() + timeout_s
        while not self.frozen and time.monotonic() < deadline:
            if self._running():
                self._post("/pause_generation", {"mode": "in_place"})
                self.frozen = True
                self.cuts += 1
            elif not can_run():
                return False
            else:
                time.sleep(0.02)
        return self.frozen

    def thaw(self) -> None:
        if self.frozen:
            self.frozen = False
            self._post("/continue_generation", {})


@pytest.fixture
def held(server, monkeypatch):
    hold = _HeldMidAnswer(monkeypatch, server.url)
    yield hold
    hold.thaw()   # never leave the module's server frozen for the next test


def prompt(tok, question):
    return tok.apply_chat_template([{"role": "user", "content": question}],
                                   add_generation_prompt=True, tokenize=True, return_dict=False)


def perturbed(model, seed):
    """The model's weights plus noise; tied tensors (SmolLM2's embedding and head) stay tied."""
    g = torch.Generator().manual_seed(seed)
    out, by_storage = {}, {}
    for k, v in model.state_dict().items():
        ptr = v.untyped_storage().data_ptr()
        if ptr not in by_storage:
            by_storage[ptr] = v + 0.01 * torch.randn(v.shape, generator=g) \
                if v.is_floating_point() else v.clone()
        out[k] = by_storage[ptr]
    return out


def test_logprobs_equal_the_trainers_forward_pass_at_each_temperature(policy, server, engines):
    model, tok = policy
    eng = engines(server.url)
    samples = [Sample(prompt(tok, q), SamplingParams(temperature=t, max_new_tokens=24))
               for q in QUESTIONS for t in (1.0, 0.7)]
    eng.generate(samples)
    assert sum(len(s.response_ids) for s in samples) >= 4 * len(samples)  # it said something
    for s in samples:
        s.check()
        assert s.finish_reason in (STOP, LENGTH) and set(s.versions) == {0}
        # the server reports the temperature-scaled distribution, as the trainer computes it
        ref = full_forward_logprobs(model, s, s.params.temperature)
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=1e-4), s.params.temperature
    hot = [s for s in samples if s.params.temperature == 0.7]
    assert not all(torch.allclose(torch.tensor(s.logprobs), full_forward_logprobs(model, s, 1.0),
                                  atol=1e-4) for s in hot)  # the temperature made a difference


def test_greedy_outputs_equal_hugging_faces_generate(policy, server, engines):
    model, tok = policy
    eng = engines(server.url)
    samples = [Sample(prompt(tok, q), SamplingParams(temperature=0.0, max_new_tokens=32))
               for q in QUESTIONS]
    eng.generate(samples)
    eos = stop_token_ids(model, tok)
    for s in samples:
        with torch.no_grad():
            out = model.generate(torch.tensor([s.prompt_ids]), do_sample=False, max_new_tokens=32,
                                 eos_token_id=eos, pad_token_id=tok.pad_token_id or eos[0])
        ref = out[0, len(s.prompt_ids):].tolist()
        assert s.response_ids == ref
    assert max(len(s.response_ids) for s in samples) >= 16


def test_abort_returns_partials_and_resubmitting_continues_them(policy, server, engines, held):
    model, tok = policy
    eng = engines(server.url)
    params = SamplingParams(temperature=0.0, max_new_tokens=80)
    whole = [Sample(prompt(tok, q), params) for q in QUESTIONS[2:]]
    eng.generate(whole)                       # uninterrupted
    cut = [Sample(list(s.prompt_ids), params) for s in whole]
    eng.submit(cut)
    assert held.freeze(lambda: eng.num_pending > 0)   # an answer is under way, and stays so
    assert not eng.step()
    parts = eng.abort()
    assert {s.request_id for s in parts} == {s.request_id for s in cut} and eng.num_pending == 0
    assert all(s.finish_reason == ABORT for s in parts)
    partial = {s.request_id: list(s.response_ids) for s in cut}
    assert any(0 < len(p) < len(w.response_ids) for p, w in zip(partial.values(), whole)), \
        "nothing was cut mid-answer: the test proves nothing"
    eng.generate(cut)                          # continue from the last token
    for s, w in zip(cut, whole):
        s.check()
        assert s.response_ids[:len(partial[s.request_id])] == partial[s.request_id]
        assert s.response_ids == w.response_ids    # nothing lost, nothing repeated
        assert torch.allclose(torch.tensor(s.logprobs), full_forward_logprobs(model, s), atol=1e-4)


@pytest.mark.parametrize("weight_sync", ["distributed", "disk"])
def test_weight_updates_load_and_tag_tokens_with_the_servers_version(
        policy, server, engines, tmp_path, monkeypatch, original_weights_after, held, weight_sync):
    model, tok = policy
    reported = []   # (the server's weight_version spans, the version the call was sent under)
    real = SGLangEngine._token_versions

    def spy(self, meta, n, dispatch_version):
        reported.append(([(x["version"], x["start"], x["end"]) for x in meta["weight_versions"]],
                         dispatch_version))
        return real(self, meta, n, dispatch_version)

    monkeypatch.setattr(SGLangEngine, "_token_versions", spy)
    eng = engines(server.url, weights_dir=tmp_path, weight_sync=weight_sync)
    new = perturbed(model, seed=1)
    eng.update_weights(new, version=1)
    info = eng._call(eng.servers[0], "GET", "/get_model_info")
    assert info["weight_version"] == "1"
    assert eng.weight_sync == weight_sync and not eng.take_warnings()   # no fallback happened
    # broadcast: nothing written; disk: one folder per version
    assert (list(tmp_path.glob("v*")) == []) == (weight_sync == "distributed")
    sent = sum(v.numel() * v.element_size() for k, v in new.items() if k != "lm_head.weight")
    assert eng.last_sync_bytes == sent
    s = Sample(prompt(tok, QUESTIONS[0]), SamplingParams(temperature=1.0, max_new_tokens=16))
    eng.generate([s])
    assert set(s.versions) == {1}
    ref_old = full_forward_logprobs(model, s)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(new)
    try:   # the server loaded the new weights: its log-probabilities are the new model's
        assert torch.allclose(torch.tensor(s.logprobs), full_forward_logprobs(model, s), atol=1e-4)
        assert not torch.allclose(torch.tensor(s.logprobs), ref_old, atol=1e-3)
        # an update while answers are being generated: they come back, continue under the new
        # weights, and each token carries the version of the weights that produced it
        long = [Sample(prompt(tok, q), SamplingParams(temperature=0.0, max_new_tokens=80))
                for q in QUESTIONS[2:]]
        eng.submit(long)
        assert held.freeze(lambda: eng.num_pending > 0)   # the update comes mid-answer
        eng.update_weights(new, version=2)
        while eng.num_pending:
            eng.step()
    finally:
        model.load_state_dict(original)
    switched = 0
    for s in long:
        s.check()
        k = s.versions.index(2) if 2 in s.versions else len(s.versions)
        assert s.versions == [1] * k + [2] * (len(s.versions) - k)
        switched += 0 < k < len(s.versions)
    assert switched, "no answer was running during the update: the test proves nothing"
    assert eng.requeued >= switched
    # every call's tokens: the server named the version the client had published
    assert reported and all(spans[0][0] == str(v) for spans, v in reported if spans)


# --- whole runs --------------------------------------------------------------------------------
class _ServerVersions:
    """Records, for every /generate reply, where its tokens start in the sample and the weight
    versions the server reported for them (meta_info.weight_versions)."""

    def __init__(self, monkeypatch):
        self.replies = []   # (sample, offset, [(version, start, end)])
        real = SGLangEngine._parse

        def parse(engine, t, res):
            if isinstance(res, dict) and res.get("meta_info"):
                spans = [(x["version"], x["start"], x["end"])
                         for x in res["meta_info"].get("weight_versions") or []]
                self.replies.append((t.sample, len(t.sample.response_ids), spans))
            return real(engine, t, res)

        monkeypatch.setattr(SGLangEngine, "_parse", parse)

    def check(self, samples) -> int:
        """Every token's version is the one the server reported for it; returns how many
        samples hold tokens of more than one version."""
        covered = {id(s): [None] * len(s.response_ids) for s in samples}
        for s, offset, spans in self.replies:
            if id(s) not in covered:
                continue
            for version, start, end in spans:
                v = 0 if version in ("default", "0") else int(version)
                for i in range(offset + start, offset + end):
                    covered[id(s)][i] = v
        for s in samples:
            assert covered[id(s)] == s.versions, (covered[id(s)], s.versions)
        return sum(len(set(s.versions)) > 1 for s in samples)


def _submitted(monkeypatch):
    """Every sample submitted to an SGLang engine, with (tokens so far, engine version) at each
    submission."""
    seen = {}
    real = SGLangEngine.submit

    def submit(engine, samples):
        samples = list(samples)
        for s in samples:
            seen.setdefault(id(s), (s, []))[1].append((len(s.response_ids), engine.version))
        return real(engine, samples)

    monkeypatch.setattr(SGLangEngine, "submit", submit)
    return seen


def run_config(model_dir, urls, *extra):
    return C.load("smollm2-math", [f"model.path={model_dir}", *RUN,
                                   f"rollout.sglang_urls={urls}", *extra])


def test_april_parks_samples_and_resumes_them_across_weight_updates(
        model_dir, server, tmp_path, monkeypatch, original_weights_after):
    from trainer.run.runner import Runner

    seen = _submitted(monkeypatch)
    versions = _ServerVersions(monkeypatch)
    cfg = run_config(model_dir, server.url, "run.max_steps=3", "april.enabled=true",
                     "april.over_sampling_batch_size=4", "april.segment_max_tokens=8")
    sink = MemorySink()
    with Runner(cfg, tmp_path, sink=sink, system_telemetry=False) as r:
        assert r.run() == "finished" and r.step == 3
    assert sum(sink.series("april/parked")) > 0
    resumed = 0
    for s, submissions in seen.values():
        s.check()
        ends = [n for n, _ in submissions[1:]] + [len(s.response_ids)]
        for (start, version), end in zip(submissions, ends):   # one segment per submission
            assert s.versions[start:end] == [version] * (end - start)
        # versions of the submissions that produced tokens (a sample aborted before its first
        # token and resubmitted under new weights holds one version only)
        resumed += len({v for (n, v), end in zip(submissions, ends) if end > n}) > 1
    assert resumed, "no sample was parked and resumed under new weights: the test proves nothing"
    assert versions.check([s for s, _ in seen.values()]) >= resumed


def test_async_updates_weights_between_steps_with_the_servers_versions(
        model_dir, server, tmp_path, monkeypatch, original_weights_after, held):
    from trainer.rollout.asynchronous import AsyncDriver
    from trainer.run.runner import Runner

    seen = _submitted(monkeypatch)
    versions = _ServerVersions(monkeypatch)
    real_collect = AsyncDriver.collect

    def collect(driver, cfg, version):
        # generation the bottleneck for sure: once the trainer has its groups, the server holds
        # an answer mid-generation until the step's weight update interrupts it (on a busy
        # machine the trainer may otherwise update only after every admitted answer finished)
        result = real_collect(driver, cfg, version)
        if not any(len(set(s.versions)) > 1 for s, _ in list(seen.values())):   # once is enough:
            held.freeze(lambda: bool(driver.running) or driver.engine.num_pending > 0)
        return result   # a frozen server generates nothing while the trainer trains

    monkeypatch.setattr(AsyncDriver, "collect", collect)
    # eta 2: up to 3 batches of groups in flight, long answers
    cfg = run_config(model_dir, server.url, "run.max_steps=3", "async.enabled=true",
                     "async.worker=thread", "async.max_staleness=2",
                     "rollout.n_samples_per_prompt=4", "rollout.max_response_len=96",
                     "data.system_prompt=Explain every step in detail.")
    sink = MemorySink()
    with Runner(cfg, tmp_path, sink=sink, system_telemetry=False) as r:
        assert r.run() == "finished" and r.step == 3
        requeued = r.engine.requeued
    assert max(sink.series("async/staleness/max")) <= 2
    samples = [s for s, _ in seen.values()]
    mixed = versions.check(samples)
    assert held.cuts, "the server never had an answer under way after a collect"
    assert mixed > 0 and requeued > 0, \
        "no answer ran through a weight update: the test proves nothing"
    assert max(v for s in samples for v in s.versions) >= 2


@pytest.fixture
def second_sglang_server(model_dir, tmp_path, sglang_prestarted):
    """A float32 server of the two-server test's own (it kills it), started in the background
    ahead of the test (tests/conftest.py: STARTERS), else now; stopped after the test."""
    pre = sglang_prestarted.pop("second_sglang_server", None)
    srv = pre.result() if pre is not None else \
        SGLangServer(model_dir, log_path=tmp_path / "second.log").start()
    try:
        yield srv
    finally:
        srv.stop()


def test_two_servers_share_requests_and_a_killed_one_hands_its_requests_over(
        model_dir, server, tmp_path, monkeypatch, original_weights_after, second_sglang_server):
    from trainer.run.runner import Runner

    calls = []   # (the server a /generate call went to, was the second one out of service?)
    killed = threading.Event()
    real = SGLangEngine._pick_server

    def pick(engine):
        srv = real(engine)
        calls.append((srv.url, engine.servers[1].down))
        return srv

    monkeypatch.setattr(SGLangEngine, "_pick_server", pick)
    second = second_sglang_server
    assert second.running and second.url != server.url
    runner = None

    class KillAfterFirstStep(MemorySink):
        """Once step 1 is logged, kill the second server while it is generating."""

        def scalars(self, step, values):
            super().scalars(step, values)
            if step == 1:
                threading.Thread(target=kill_when_busy, daemon=True).start()

    def kill_when_busy():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not runner.engine.servers[1].inflight:
            time.sleep(0.005)
        second.kill()
        killed.set()

    try:
        cfg = run_config(model_dir, f"{server.url},{second.url}", "run.max_steps=3")
        sink = KillAfterFirstStep()
        with Runner(cfg, tmp_path / "run", sink=sink, system_telemetry=False) as r:
            runner = r
            assert r.run() == "finished" and r.step == 3
            assert r.engine.servers[1].down and not r.engine.servers[0].down
            assert r.engine.requeued >= 1   # what ran on the killed server was sent again
    finally:
        second.stop()
    assert killed.is_set()
    before = [url for url, down in calls if not down]
    assert before.count(server.url) > 0 and before.count(second.url) > 0   # spread over both
    after = [url for url, down in calls if down]
    assert after and set(after) == {server.url}   # then only the survivor
    warnings = [e for e in sink.events if e["kind"] == "warning"]
    assert any(second.url in e["message"] and "out of service" in e["message"]
               for e in warnings), sink.events


# --- precision: rollout.dtype and the training–inference mismatch -----------------------------
MISMATCH = ["mismatch.lower=0.98", "mismatch.upper=1.02"]   # a narrow band: bfloat16 leaves it


class _KnobsAtSteps(ControlSource):
    """`{after step: knobs}`: each set once the run has finished that many steps."""

    def __init__(self, plan):
        self.plan, self.runner = dict(plan), None

    def poll(self):
        knobs = self.plan.pop(self.runner.step, None) if self.runner is not None else None
        return [Command(SET_KNOBS, knobs=knobs)] if knobs else []


def _started(sink) -> dict:
    return next(e for e in sink.events if e["kind"] == "run_started")


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bf16_server_of_a_child(model_dir, tmp_path_factory):
    """A bfloat16 server started by a child process: it serves the bfloat16 test, then the kill
    test SIGKILLs the child. Yields the child, the server's process group and its URL; whatever
    is left is killed at the end."""
    log = tmp_path_factory.mktemp("sglang-bf16") / "bf16.log"
    code = ("import time\nfrom trainer.engine.sglang.server import SGLangServer\n"
            f"s = SGLangServer({str(model_dir)!r}, dtype='bfloat16', log_path={str(log)!r}).start()\n"
            "print(s.proc.pid, s.url, flush=True)\ntime.sleep(3600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT)
    group = None
    try:
        line = parent.stdout.readline().split()
        assert len(line) == 2, f"the child started no server: {line} (its log: {log})"
        group = int(line[0])
        yield SimpleNamespace(parent=parent, group=group, url=line[1])
    finally:
        parent.kill()
        parent.wait()
        if group is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, 9)


def test_a_bfloat16_server_shows_the_mismatch_and_trains_with_each_correction(
        model_dir, server, tmp_path, bf16_server_of_a_child):
    """A bfloat16 server (SGLang's CPU engine serves it) against the float32 trainer: figures
    orders of magnitude above the float32 server's, a run that trains with truncate, then mask,
    then band (knob changes between steps), new weights broadcast in bfloat16; and an explicit
    rollout.dtype that a server does not serve is refused, naming it. Measured on this CPU
    (3 steps): mean |d| 0.021-0.032, max 0.09-0.42, KL (k3) 5e-4-1.7e-3, 40-48% of the tokens
    outside [0.98, 1.02]."""
    from trainer.run.runner import Runner

    half = bf16_server_of_a_child   # SGLangServer(model_dir, dtype="bfloat16"), in a child
    assert half.parent.poll() is None, "the child that started the bfloat16 server is gone"
    with pytest.raises(EngineError) as e:
        SGLangEngine(half.url, dtype="float32")
    assert str(e.value) == (f"rollout.dtype=float32 but SGLang server {half.url} serves "
                            "bfloat16 (its --dtype); start it with --dtype float32 or set "
                            "rollout.dtype=auto")
    with pytest.raises(EngineError, match=f"{server.url} serves float32"):
        SGLangEngine(f"{half.url},{server.url}", dtype="bfloat16")
    controls = _KnobsAtSteps({1: {"mismatch.correction": "mask"},
                              2: {"mismatch.correction": "band"}})
    cfg = run_config(model_dir, half.url, "run.max_steps=3", "rollout.dtype=bfloat16",
                     "mismatch.correction=truncate", *MISMATCH)
    sink = MemorySink()
    with Runner(cfg, tmp_path / "run", sink=sink, controls=controls,
                system_telemetry=False) as r:
        controls.runner = r
        assert r.run() == "finished" and r.step == 3
        assert r.engine.weight_sync == "distributed"   # no fall-back to disk
        sd = r.model.state_dict()
        bf16_bytes = sum(t.numel() * 2 for k, t in sd.items() if k != "lm_head.weight")
    assert (_started(sink)["model_dtype"], _started(sink)["rollout_dtype"]) == ("float32", "bfloat16")
    assert [e["kind"] for e in sink.events if e["kind"] in ("warning", "error")] == []
    assert [e["changes"] for e in sink.events if e["kind"] == "knob_applied"] == [
        {"mismatch.correction": {"old": "truncate", "new": "mask"}},
        {"mismatch.correction": {"old": "mask", "new": "band"}}]
    s = {k: sink.series(f"mismatch/{k}") for k in (
        "kl", "abs_logp_diff", "abs_logp_diff_max", "outside_band_ratio", "correction_weight",
        "correction_zeroed_ratio")}
    assert min(s["abs_logp_diff"]) > 5e-3 and min(s["abs_logp_diff_max"]) > 2e-2
    assert min(s["kl"]) > 1e-5
    # the weights each update broadcast kept the server with the trainer: no drift past bfloat16's
    assert max(s["abs_logp_diff"]) < 0.1
    assert all(x > 0 for x in s["outside_band_ratio"])
    truncate, mask, band = ({k: v[step] for k, v in s.items()} for step in range(3))
    # truncation is reported at the truncate step alone
    truncated = sink.series("mismatch/correction_truncated_ratio")
    assert len(truncated) == 1 and truncated[0] > 0 and truncate["correction_zeroed_ratio"] == 0
    assert mask["correction_zeroed_ratio"] > 0
    assert band["correction_zeroed_ratio"] == pytest.approx(band["outside_band_ratio"])
    assert band["correction_weight"] == pytest.approx(1 - band["correction_zeroed_ratio"])
    assert sink.series("perf/weight_sync_bytes") == [bf16_bytes] * 3   # bfloat16 on the wire


def test_a_server_ends_with_the_process_that_started_it_even_when_that_one_is_killed(
        bf16_server_of_a_child):
    """SIGKILL the process that started a server: its whole group (launcher, scheduler,
    detokenizer -- the CPU scheduler spins a core even idle without --sleep-on-idle) is gone
    soon after (group_guard.py). The server is the bfloat16 test's (after it, in file order)."""
    child = bf16_server_of_a_child
    assert child.parent.poll() is None, "the child that started the server is gone already"

    def members() -> int:
        ps = subprocess.run(["ps", "-eo", "pgid="], capture_output=True, text=True).stdout.split()
        return sum(1 for g in ps if int(g) == child.group)

    assert members() >= 3, "the server's scheduler and detokenizer are not in its group"
    child.parent.kill()
    child.parent.wait()
    deadline = time.monotonic() + 60
    while members() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert members() == 0, "the server outlived the process that started it"


def test_multi_turn_episodes_generate_each_turn_on_the_server(model_dir, server, tmp_path):
    """The server generates every model turn; the client keeps the conversation (the feedback
    after a wrong answer is environment tokens it sends back as context). APRIL, GRESO and
    asynchronous training together: turns cut at APRIL's segment limit and continued, on the
    worker thread (each technique alone, and the synchronous driver: tests/test_episode_runs.py,
    on CPU engines). One step trains 4 groups: eta 1 and 4 groups generating at once (eta 2 and
    the default 2B had 8 at once, 12 in all: 200 s here; each episode shares the one server core)."""
    from trainer.engine.base import ENV_VERSION
    from trainer.run.runner import Runner

    every = ["april.enabled=true", "april.segment_max_tokens=8", "greso.enabled=true",
             "async.enabled=true", "async.worker=thread", "async.max_staleness=1",
             "async.max_inflight=4"]
    # short answers that end their turn (a wrong one gets feedback and a second turn); 16
    # episodes: with 4, every one ended after its first turn in one CI run (right, or cut at the
    # response limit without ending its turn)
    cfg = run_config(model_dir, server.url, "run.max_steps=1", "episode.max_turns=2",
                     "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "rollout.max_slots=16",
                     "episode.feedback=true", "episode.tools=calculator", "rollout.max_response_len=96",
                     # every group recorded (not 2 drawn at random): a second model turn is
                     # looked for among all of them; 96 tokens leave room for one after the feedback
                     "run.log_samples=16",
                     "data.system_prompt=Reply with one short sentence.", *every)
    sink = MemorySink()
    with Runner(cfg, tmp_path, sink=sink, system_telemetry=False) as r:
        assert r.run() == "finished" and r.step == 1
    assert max(sink.series("episode/turns/max")) == 2
    assert sum(sink.series("episode/env_tokens")) > 0
    rows = [row for row in sink.sample_rows if any(v == ENV_VERSION for v, _ in row["segments"])]
    assert rows, "no recorded sample had a second turn: the test proves nothing"
    second = [row for row in rows if row["segments"][-1][0] != ENV_VERSION]
    assert second   # a model turn after the environment's, generated by the server


def test_a_lora_run_sends_the_server_its_merged_weights(model_dir, server, tmp_path,
                                                        original_weights_after, engines, policy):
    """SGLang reloads whole models: each update of a LoRA run is the merged policy (the adapted
    layers W + alpha/r B A, the rest the base); afterwards the server decodes that policy."""
    from trainer.models import lora
    from trainer.run.runner import Runner

    # rewards that differ within a group whatever the model solves: in 24 tokens SmolLM2 solves
    # none (every reward 0 in two CI runs: no advantage, no gradient, the adapters never moved);
    # answers end at their first full stop and the overlong ramp covers every length
    cfg = run_config(model_dir, server.url, "run.max_steps=2", "lora.rank=8", "lora.alpha=64",
                     "rollout.stop='[\".\"]'", "algo.overlong_penalty=true", "algo.overlong_buffer=23",
                     "optim.lr=5e-3", "algo.track_kl=true", "rollout.rollout_batch_size=4",
                     "rollout.n_samples_per_prompt=4", "rollout.max_slots=16",
                     "rollout.dtype=float32", *MISMATCH)
    sink = MemorySink()
    with Runner(cfg, tmp_path, sink=sink, system_telemetry=False) as r:
        assert r.run() == "finished" and r.step == 2
        merged = lora.merged_copy(r.model).eval()
        # the whole model as the servers take it (the tied head is the embedding: not sent)
        whole = sum(t.numel() * t.element_size() for name, t in lora.merged_weights(r.model).items()
                    if name != "lm_head.weight")
    assert sum(sink.series("rollout/trained_tokens")) > 0, "nothing trained: the test proves nothing"
    assert max(sink.series("actor/grad_norm")) > 0, "no gradient reached the adapters: nothing to serve"
    assert set(sink.series("perf/weight_sync_bytes")) == {whole}
    # a float32 server (the module's) and the trainer agree to float rounding, before and after
    # an update: its log-probabilities are the trainer's (the mismatch figures of both steps;
    # measured on this CPU without LoRA: mean |d| 2.6e-6 and 2.7e-6, max 1.6e-5 and 1.8e-5,
    # KL (k3) 8e-12 and 9e-12), and an explicit rollout.dtype=float32 is accepted
    assert (_started(sink)["model_dtype"], _started(sink)["rollout_dtype"]) == ("float32", "float32")
    assert len(sink.series("mismatch/kl")) == 2
    assert max(sink.series("mismatch/abs_logp_diff")) < 5e-5
    assert max(sink.series("mismatch/abs_logp_diff_max")) < 5e-4
    assert max(map(abs, sink.series("mismatch/kl"))) < 1e-9
    assert max(sink.series("mismatch/outside_band_ratio")) == 0
    _, tok = policy
    eng = engines(server.url)
    samples = [Sample(prompt(tok, q), SamplingParams(temperature=1.0, max_new_tokens=16))
               for q in QUESTIONS]
    eng.generate(samples)
    base, _ = policy
    moved = 0
    for s in samples:
        got = torch.tensor(s.logprobs)
        assert torch.allclose(got, full_forward_logprobs(merged, s), atol=1e-4)
        moved += not torch.allclose(got, full_forward_logprobs(base, s), atol=1e-4)
    assert moved, "the adapters did not change the served policy: the test proves nothing"
