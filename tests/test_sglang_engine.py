"""The SGLang client engine against the test stand-in server (tests/fakes/sglang_standin.py, NOT
a real SGLang server): same tokens and log-probabilities as the embedded engine, abort + resume,
weight updates with per-token versions, and clear errors (no hangs) when a server is down,
failing or slow."""
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from fakes.sglang_standin import StandinServer
from helpers import full_forward_logprobs

from trainer.engine.base import ABORT, SEGMENT, STOP, EngineError, Sample, SamplingParams
from trainer.engine.embedded import EmbeddedEngine
from trainer.engine.sglang import SGLangEngine, parse_urls
from trainer.models.loading import load_model, load_tokenizer

LONG = "[" + ",".join(["9"] * 20) + "]="
TEXTS = ["[3,5]=", "[1,2,3,4,5,6,7,8,9,1,2,3]=", "[9]=", "[4,4,4,4]=", "[7,1,8,2,6]="]


@pytest.fixture(scope="module")
def builtin():
    model = load_model("builtin", torch.device("cpu"), torch.float32).eval()
    return model, load_tokenizer("builtin")


@pytest.fixture
def server(builtin):
    """Start a stand-in on a free 127.0.0.1 port; `server(step_delay_s=...)` for options."""
    model, tok = builtin
    started = []

    def make(**kw):
        srv = StandinServer(model, tok, eos_token_ids=[tok.eos_token_id], max_slots=8,
                            max_seq_len=400, **kw).start()
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.close()


@pytest.fixture
def engines():
    made = []

    def make(url, tok, model=None, **kw):
        kw.setdefault("retries", 2)
        kw.setdefault("backoff_s", 0.05)
        kw.setdefault("down_timeout_s", 1.0)
        eng = SGLangEngine(url, eos_token_ids=[tok.eos_token_id],
                           model_config=None if model is None else model.config, **kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


def ids(tok, text):
    return tok(text).input_ids


def greedy_alone(model, tok, prompt, max_new=200):
    s = Sample(list(prompt), SamplingParams(temperature=0.0, max_new_tokens=max_new))
    EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=1,
                   max_seq_len=400).generate([s])
    return s


def wait_until(cond, timeout=20.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        time.sleep(0.01)


def running_lengths(srv):
    with srv.cv:
        return [len(s.response_ids) for s in srv.engine.slots]


def test_tokens_and_logprobs_match_the_embedded_engine(builtin, server, engines):
    model, tok = builtin
    srv = server()
    eng = engines(srv.url, tok, model)
    sampled = [Sample(ids(tok, t), SamplingParams(temperature=1.0, max_new_tokens=80))
               for t in TEXTS * 2]
    out = eng.generate(sampled)
    assert {s.request_id for s in out} == {s.request_id for s in sampled}
    assert eng.num_pending == 0
    for s in sampled:
        s.check()
        assert s.response_ids and s.finish_reason in ("stop", "length")
        assert torch.allclose(torch.tensor(s.logprobs), full_forward_logprobs(model, s), atol=1e-4)
        assert set(s.versions) == {0}
    greedy = [Sample(ids(tok, t), SamplingParams(temperature=0.0, max_new_tokens=120))
              for t in TEXTS]
    eng.generate(greedy)
    for s in greedy:
        ref = greedy_alone(model, tok, s.prompt_ids, 120)
        assert s.response_ids == ref.response_ids and s.finish_reason == ref.finish_reason
        assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(ref.logprobs), atol=1e-4)
    assert eng.stats.generated_tokens == sum(len(s.response_ids) for s in sampled + greedy)


def test_segment_limit_parks_and_continues(builtin, server, engines):
    model, tok = builtin
    eng = engines(server().url, tok)
    s = Sample(ids(tok, LONG), SamplingParams(temperature=0.0, max_new_tokens=200,
                                              segment_max_tokens=16))
    segments = 0
    while not s.done:
        eng.generate([s])
        segments += 1
        assert s.finish_reason in (SEGMENT, STOP, "length")
    ref = greedy_alone(model, tok, s.prompt_ids)
    assert s.response_ids == ref.response_ids
    assert segments == -(-len(ref.response_ids) // 16)


def test_abort_returns_partials_that_continue_to_the_uninterrupted_result(builtin, server, engines):
    model, tok = builtin
    srv = server(step_delay_s=0.005)
    eng = engines(srv.url, tok)
    prompts = [ids(tok, LONG), ids(tok, "[" + ",".join(["8"] * 18) + "]="), ids(tok, LONG)]
    samples = [Sample(p, SamplingParams(temperature=0.0, max_new_tokens=200)) for p in prompts]
    eng.submit(samples)
    wait_until(lambda: len(running_lengths(srv)) == 3 and min(running_lengths(srv)) >= 5)
    # one sample alone first: the others keep running
    one = eng.abort([samples[0].request_id])
    assert [s.request_id for s in one] == [samples[0].request_id]
    assert one[0].finish_reason == ABORT and len(one[0].response_ids) >= 5
    assert eng.num_pending == 2
    rest = eng.abort()
    assert {s.request_id for s in rest} == {s.request_id for s in samples[1:]}
    assert all(s.finish_reason == ABORT for s in rest) and eng.num_pending == 0
    wait_until(lambda: not srv.requests)  # the server stopped them too
    prefixes = {s.request_id: list(s.response_ids) for s in samples}
    eng.generate(samples)  # continue from the last token
    for s in samples:
        s.check()
        ref = greedy_alone(model, tok, s.prompt_ids)
        assert s.response_ids == ref.response_ids  # nothing lost, nothing duplicated
        assert s.response_ids[:len(prefixes[s.request_id])] == prefixes[s.request_id]
        assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(ref.logprobs), atol=1e-4)
        assert s.finish_reason in ("stop", "length")


def test_abort_of_queued_samples_and_of_nothing(builtin, server, engines):
    model, tok = builtin
    srv = server(step_delay_s=0.005)
    eng = engines(srv.url, tok, max_inflight=1)
    samples = [Sample(ids(tok, LONG), SamplingParams(max_new_tokens=150)) for _ in range(3)]
    eng.submit(samples)
    assert eng.num_running == 1 and eng.num_pending == 3
    parts = eng.abort()
    assert {s.request_id for s in parts} == {s.request_id for s in samples}
    assert all(s.finish_reason == ABORT for s in parts)
    assert eng.abort() == [] and eng.step() == []


def test_update_weights_tags_later_tokens_and_loads_the_weights(builtin, server, engines, tmp_path):
    model, tok = builtin
    srv = server(step_delay_s=0.005)
    eng = engines(srv.url, tok, model, weights_dir=tmp_path / "w")
    s = Sample(ids(tok, LONG), SamplingParams(max_new_tokens=150))
    eng.submit([s])
    wait_until(lambda: running_lengths(srv) and running_lengths(srv)[0] >= 6)
    eng.abort()
    n_old = len(s.response_ids)
    assert n_old >= 6 and set(s.versions) == {0}
    torch.manual_seed(1)
    model2 = load_model("builtin", torch.device("cpu"), torch.float32).eval()
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(0.02 * torch.randn_like(p))
    eng.update_weights(model2.state_dict(), version=3)
    assert eng.version == 3 and srv.weight_version == "3"
    saved = sorted((tmp_path / "w").iterdir())
    assert [p.name for p in saved] == ["v000003"]
    assert {"config.json", "model.safetensors"} <= {p.name for p in saved[0].iterdir()}
    eng.generate([s])
    s.check()
    assert s.versions[:n_old] == [0] * n_old and set(s.versions[n_old:]) == {3}
    ref_new = full_forward_logprobs(model2, s)
    assert torch.allclose(torch.tensor(s.logprobs[n_old:]), ref_new[n_old:], atol=1e-4)
    # the folder is a save_pretrained layout transformers can load
    from transformers import AutoModelForCausalLM
    again = AutoModelForCausalLM.from_pretrained(str(saved[0]), local_files_only=True)
    assert torch.equal(again.state_dict()["model.norm.weight"], model2.state_dict()["model.norm.weight"])


def test_update_during_generation_resubmits_without_losing_tokens(builtin, server, engines, tmp_path):
    model, tok = builtin
    srv = server(step_delay_s=0.005)
    eng = engines(srv.url, tok, model, weights_dir=tmp_path)
    samples = [Sample(ids(tok, LONG), SamplingParams(temperature=0.0, max_new_tokens=200))
               for _ in range(2)]
    eng.submit(samples)
    wait_until(lambda: len(running_lengths(srv)) == 2 and min(running_lengths(srv)) >= 5)
    eng.update_weights(model.state_dict(), version=1)  # same weights, new version
    assert not srv.paused
    while eng.num_pending:
        eng.step()
    ref = greedy_alone(model, tok, samples[0].prompt_ids)
    for s in samples:
        s.check()
        assert s.response_ids == ref.response_ids
        k = s.versions.index(1)
        assert k >= 5 and s.versions == [0] * k + [1] * (len(s.versions) - k)
    assert eng.requeued >= 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_server_down_is_a_clear_error_after_bounded_retries(builtin):
    _, tok = builtin
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"127\.0\.0\.1.*GET /health.*3 attempts.*refused"):
        SGLangEngine(url, eos_token_ids=[tok.eos_token_id], retries=2, backoff_s=0.05)
    assert time.monotonic() - t0 < 5


def test_server_dying_mid_run_fails_generate_without_hanging(builtin, server, engines):
    _, tok = builtin
    srv = server()
    eng = engines(srv.url, tok)
    srv.close()
    t0 = time.monotonic()   # it waits down_timeout_s (1 s here) for the server to come back
    with pytest.raises(EngineError, match=r"no SGLang server has answered for more than 1 s "
                                          r"\(last: .*POST /generate failed after 3 attempts"):
        eng.generate([Sample(ids(tok, "[1,2]="), SamplingParams(max_new_tokens=20))])
    assert time.monotonic() - t0 < 5
    assert "every SGLang server is out of service" in eng.take_warnings()[0]


def test_http_500_is_retried_then_a_clear_error(builtin, server, engines):
    _, tok = builtin
    srv = server()
    eng = engines(srv.url, tok)
    srv.fail_next(1, 500)
    s = Sample(ids(tok, "[1,2]="), SamplingParams(max_new_tokens=20))
    eng.generate([s])  # one failure: the retry succeeds
    assert s.done and srv.generate_calls == 2
    srv.fail_next(100, 500)
    with pytest.raises(EngineError, match=rf"{srv.url}: POST /generate failed .*HTTP 500"):
        eng.generate([Sample(ids(tok, "[1,2]="), SamplingParams(max_new_tokens=20))])
    eng = engines(srv.url, tok)   # the first one waits for its server (out of service) no more
    srv.fail_next(1, 400)  # a 4xx is not retried
    with pytest.raises(EngineError, match="refused the request: HTTP 400"):
        eng.generate([Sample(ids(tok, "[1,2]="), SamplingParams(max_new_tokens=20))])


def test_a_slow_server_times_out_into_an_error(builtin, server, engines):
    _, tok = builtin
    srv = server(step_delay_s=0.1)
    eng = engines(srv.url, tok, timeout_s=0.3, retries=1)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="POST /generate failed after 2 attempts: timed out"):
        eng.generate([Sample(ids(tok, LONG), SamplingParams(max_new_tokens=150))])
    assert time.monotonic() - t0 < 5


def test_urls_and_config(builtin, server):
    from trainer import config as config_mod
    from trainer.run.engines import build_engine

    assert parse_urls(" http://a:1/, http://b:2 ") == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match="not an http"):
        parse_urls("a:1")
    with pytest.raises(config_mod.ConfigError, match="rollout.sglang_urls"):
        config_mod.load("demo", ["rollout.engine=sglang"])
    model, tok = builtin
    srv = server()
    cfg = config_mod.load("demo", ["rollout.engine=sglang", f"rollout.sglang_urls={srv.url}"])
    eng = build_engine(cfg, model, tok, torch.device("cpu"), torch.float32, 300)
    try:
        assert isinstance(eng, SGLangEngine) and eng.servers[0].url == srv.url
    finally:
        eng.close()
    cfg = config_mod.load("demo", [])
    assert isinstance(build_engine(cfg, model, tok, torch.device("cpu"), torch.float32, 300),
                      EmbeddedEngine)


def test_two_servers_share_the_load(builtin, server, engines):
    model, tok = builtin
    a, b = server(), server()
    eng = engines(f"{a.url},{b.url}", tok)
    samples = [Sample(ids(tok, t), SamplingParams(temperature=0.0, max_new_tokens=60))
               for t in TEXTS * 2]
    eng.generate(samples)
    assert a.generate_calls > 0 and b.generate_calls > 0
    for s in samples[:len(TEXTS)]:
        assert s.response_ids == greedy_alone(model, tok, s.prompt_ids, 60).response_ids


def test_a_failing_server_is_taken_out_and_its_samples_go_to_the_other(builtin, server, engines,
                                                                        tmp_path):
    model, tok = builtin
    a, b = server(), server(step_delay_s=0.01)
    eng = engines(f"{a.url},{b.url}", tok, model, weights_dir=tmp_path, rejoin_backoff_s=60)
    samples = [Sample(ids(tok, LONG), SamplingParams(temperature=0.0, max_new_tokens=200))
               for _ in range(4)]
    eng.submit(samples)
    wait_until(lambda: b.requests)
    b.fail_next(100, 503)   # every retry of what b was running fails from now on
    with b.cv:
        b._abort(None)      # its running calls come back aborted and are resent: to b, failing
    while eng.num_pending:
        eng.step()
    ref = greedy_alone(model, tok, samples[0].prompt_ids)
    for s in samples:
        s.check()
        assert s.response_ids == ref.response_ids   # the partial answers continued on a
    assert eng.servers[1].down and not eng.servers[0].down
    warnings = eng.take_warnings()
    assert len(warnings) == 1 and b.url in warnings[0] and "out of service" in warnings[0]
    assert eng.take_warnings() == []
    calls = a.generate_calls
    eng.generate([Sample(ids(tok, "[1,2]="), SamplingParams(max_new_tokens=20))])
    assert a.generate_calls == calls + 1   # b gets nothing more
    b.close()
    eng.update_weights(model.state_dict(), version=1)   # skips the server out of service
    assert a.weight_version == "1"


def test_standin_cli_listens_on_localhost_only():
    script = Path(__file__).parent / "fakes" / "sglang_standin.py"
    proc = subprocess.Popen([sys.executable, str(script), "--port", "0", "--threads", "1"],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "not SGLang" in line
        url = line.strip().rsplit(" ", 1)[-1]
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert r.status == 200
        with urllib.request.urlopen(url + "/get_model_info", timeout=10) as r:
            assert json.loads(r.read())["weight_version"] == "default"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_abort_right_after_submit_and_close_do_not_hang(builtin, server, engines):
    _, tok = builtin
    srv = server(step_delay_s=0.02)
    eng = engines(srv.url, tok)
    samples = [Sample(ids(tok, LONG), SamplingParams(max_new_tokens=150)) for _ in range(4)]
    eng.submit(samples)  # the calls may not have reached the server yet
    parts = eng.abort()
    assert {s.request_id for s in parts} == {s.request_id for s in samples}
    assert all(s.finish_reason == ABORT for s in parts) and eng.num_pending == 0
    for s in parts:
        s.check()
    wait_until(lambda: not srv.requests, timeout=10)  # none left running on the server
    eng.submit(parts)
    eng.step()
    t0 = time.monotonic()
    eng.close()
    assert time.monotonic() - t0 < 3
    wait_until(lambda: not [t for t in threading.enumerate()
                            if t.name.startswith("rlpilot-sglang")], timeout=5)
    with pytest.raises(EngineError, match="closed"):
        eng.step()


class _RawServer:
    """A bare HTTP/1.0-style server: answers every call with `reply(request_line)`, or never
    answers when that returns None (the connection stays open)."""

    def __init__(self, reply):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.reply, self.held, self.lines = reply, [], []
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
            line = data.split(b"\r\n", 1)[0].decode()
            self.lines.append(line)
            out = self.reply(line)
            if out is None:
                self.held.append(conn)
                continue
            conn.sendall(out)
            conn.close()

    def close(self):
        self.sock.close()
        for c in self.held:
            c.close()


def _http(status, body=b"", headers=""):
    return (f"HTTP/1.1 {status} X\r\n{headers}Content-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


def test_close_wakes_calls_blocked_on_a_server_that_never_answers(builtin):
    _, tok = builtin
    srv = _RawServer(lambda line: None if line.startswith("POST /generate") else _http(200))
    try:
        eng = SGLangEngine(srv.url, eos_token_ids=[tok.eos_token_id], retries=2, backoff_s=0.05)
        eng.submit([Sample(ids(tok, "[1,2]="), SamplingParams(max_new_tokens=20))])
        wait_until(lambda: any(x.startswith("POST /generate") for x in srv.lines), timeout=10)
        t0 = time.monotonic()
        eng.close()
        assert time.monotonic() - t0 < 3
        # the pool's thread was blocked reading the reply (timeout_s = 300): close() woke it
        wait_until(lambda: not [t for t in threading.enumerate()
                                if t.name.startswith("rlpilot-sglang")], timeout=5)
    finally:
        srv.close()


def test_errors_never_quote_the_server_and_redirects_are_not_followed(builtin, tmp_path):
    _, tok = builtin
    replies = {"GET /health": _http(200),
               "POST /pause_generation": _http(503, b"SECRET-503"),
               "POST /continue_generation": _http(302, headers="Location: http://127.0.0.1:9/\r\n"),
               "POST /generate": b"SECRET-STATUS-LINE\r\n\r\n"}
    srv = _RawServer(lambda line: replies.get(line.rsplit(" ", 1)[0], _http(404, b"SECRET-404")))
    eng = SGLangEngine(srv.url, eos_token_ids=[tok.eos_token_id], retries=1, backoff_s=0.01,
                       weights_dir=tmp_path)
    try:
        eng.update_weights({"w": torch.zeros(2)}, version=1)   # the server is taken out of service
        assert eng.take_warnings()[0].startswith(
            f"SGLang server {srv.url}: POST /pause_generation failed after 2 attempts: HTTP 503; ")
        assert srv.lines.count("POST /pause_generation HTTP/1.1") == 2
        with pytest.raises(EngineError) as e:
            eng._call(eng.servers[0], "POST", "/no_such_call", {})
        assert str(e.value) == f"SGLang server {srv.url}: POST /no_such_call refused: HTTP 404"
        assert srv.lines.count("POST /no_such_call HTTP/1.1") == 1   # a 4xx is not retried
        assert eng._call(eng.servers[0], "POST", "/continue_generation", {}) is None
        fresh = SGLangEngine(srv.url, eos_token_ids=[tok.eos_token_id], retries=1, backoff_s=0.01,
                             down_timeout_s=0.5)
        try:
            with pytest.raises(EngineError) as e:
                fresh.generate([Sample(ids(tok, "[1,2]="), SamplingParams(max_new_tokens=20))])
        finally:
            fresh.close()
        assert str(e.value) == (f"no SGLang server has answered for more than 0.5 s (last: SGLang "
                                f"server {srv.url}: POST /generate failed after 2 attempts: "
                                "BadStatusLine)")   # not the line the server sent
    finally:
        eng.close()
        srv.close()


def test_with_every_server_gone_generation_waits_and_goes_on_when_one_comes_back(builtin, server,
                                                                                engines):
    model, tok = builtin
    srv = server(step_delay_s=0.01)
    eng = engines(srv.url, tok, down_timeout_s=30, rejoin_backoff_s=0.2)
    samples = [Sample(ids(tok, LONG), SamplingParams(temperature=0.0, max_new_tokens=150))
               for _ in range(3)]
    eng.submit(samples)
    # the only server goes away mid-generation: held in place (an in_place pause) once every
    # answer is under way, so none can finish before it is gone, however late this thread runs
    wait_until(lambda: len(running_lengths(srv)) == len(samples) and all(running_lengths(srv)))
    srv.pause_generation({"mode": "in_place"})
    assert 0 < max(running_lengths(srv)) < 150
    port = srv.port
    srv.close()
    back = []

    def restart():
        time.sleep(1.0)
        back.append(server(step_delay_s=0.0, port=port))

    threading.Thread(target=restart, daemon=True).start()
    while eng.num_pending:
        eng.step()
    assert back, "the samples finished before the server came back: the test proves nothing"
    ref = greedy_alone(model, tok, samples[0].prompt_ids, 150)
    for s in samples:   # the partial answers continued on the server that came back
        s.check()
        assert s.response_ids == ref.response_ids
    warnings = eng.take_warnings()
    assert "every SGLang server is out of service" in warnings[0]
    assert warnings[-1] == f"SGLang server {srv.url} is back in service"
    assert back[0].generate_calls > 0


def test_a_server_back_after_an_update_takes_requests_once_it_has_the_current_weights(
        builtin, server, engines, tmp_path):
    model, tok = builtin
    a, b = server(), server()
    eng = engines(f"{a.url},{b.url}", tok, model, weights_dir=tmp_path, rejoin_backoff_s=0.2)
    eng.update_weights(model.state_dict(), version=1)
    port = b.port
    b.close()
    eng.generate([Sample(ids(tok, "[1,2]="), SamplingParams(max_new_tokens=20)) for _ in range(4)])
    assert eng.servers[1].down
    b2 = server(port=port)                        # back, with the weights it started with
    wait_until(lambda: (eng.step(), not eng.servers[1].down)[1], timeout=10)
    assert eng.servers[1].stale                  # a is generating: b waits for the next update
    eng.generate([Sample(ids(tok, "[3,4]="), SamplingParams(max_new_tokens=20)) for _ in range(4)])
    assert b2.generate_calls == 0
    eng.update_weights(model.state_dict(), version=2)
    assert b2.weight_version == "2" and not eng.servers[1].stale
    samples = [Sample(ids(tok, "[5,6]="), SamplingParams(max_new_tokens=20)) for _ in range(6)]
    eng.generate(samples)
    assert b2.generate_calls > 0 and all(set(s.versions) == {2} for s in samples)
    assert any("takes requests after the next weight update" in w for w in eng.take_warnings())


def test_requests_go_to_the_server_with_the_fewest_outstanding_tokens(builtin, server, engines):
    _, tok = builtin
    a, b = server(step_delay_s=0.02), server(step_delay_s=0.02)
    eng = engines(f"{a.url},{b.url}", tok)
    long = Sample(ids(tok, LONG), SamplingParams(temperature=0.0, max_new_tokens=200))
    short = [Sample(ids(tok, "[1,2]="), SamplingParams(max_new_tokens=10)) for _ in range(3)]
    eng.submit([long])
    first = eng._tickets[long.request_id].server
    eng.submit(short)   # 10 + 10 + 10 outstanding tokens stay under the long answer's 200
    assert {eng._tickets[s.request_id].server.url for s in short} == {
        (b if first.url == a.url else a).url}
    assert first.outstanding == 200 and first.inflight == 1
    while eng.num_pending:
        eng.step()
    assert all(srv.outstanding == 0 and srv.inflight == 0 for srv in eng.servers)


def test_a_server_waiting_for_weights_gets_them_when_the_last_generating_one_dies(
        builtin, server, engines, tmp_path):
    model, tok = builtin
    a, b = server(), server()
    eng = engines(f"{a.url},{b.url}", tok, model, weights_dir=tmp_path, rejoin_backoff_s=0.2,
                  down_timeout_s=30)
    eng.update_weights(model.state_dict(), version=1)
    port = b.port
    b.close()
    eng.generate([Sample(ids(tok, "[1,2]="), SamplingParams(max_new_tokens=20)) for _ in range(4)])
    b2 = server(port=port)
    wait_until(lambda: (eng.step(), eng.servers[1].stale)[1], timeout=10)
    a.close()                                     # the only server with version 1 goes
    samples = [Sample(ids(tok, "[3,4]="), SamplingParams(max_new_tokens=20)) for _ in range(4)]
    eng.generate(samples)                         # b gets version 1 from the engine's host copy
    assert b2.weight_version == "1" and not eng.servers[1].stale
    assert b2.generate_calls > 0 and all(set(s.versions) == {1} for s in samples)
    assert any("back in service with weights version 1" in w for w in eng.take_warnings())


# --- precision (rollout.dtype) -------------------------------------------------------------------
def test_the_servers_dtype_is_recorded_and_an_explicit_rollout_dtype_must_match(
        builtin, server, engines, tmp_path):
    """/server_info's dtype: recorded with rollout.dtype auto, required to match an explicit one
    (refused at engine start, naming the server and the knob), weights sent in it; a server
    back at another dtype stays out of service."""
    model, tok = builtin
    half = server(dtype=torch.bfloat16)
    eng = engines(half.url, tok, model, weights_dir=tmp_path)        # rollout.dtype = auto
    assert eng.served_dtype == "bfloat16" and not eng.take_warnings()
    eng.update_weights(model.state_dict(), version=1)   # the trainer's float32, sent in bfloat16
    from safetensors import safe_open

    with safe_open(str(tmp_path / "v000001" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert eng.last_sync_bytes == sum(t.numel() * 2 for k, t in model.state_dict().items()
                                      if not k.endswith("inv_freq")
                                      and not (model.config.tie_word_embeddings and k == "lm_head.weight"))
    s = Sample(ids(tok, "[3,5]="), SamplingParams(max_new_tokens=20))
    eng.generate([s])
    assert set(s.versions) == {1} and s.response_ids
    with pytest.raises(EngineError) as e:
        engines(half.url, tok, dtype="float32")
    assert str(e.value) == (f"rollout.dtype=float32 but SGLang server {half.url} serves bfloat16 "
                            "(its --dtype); start it with --dtype float32 or set rollout.dtype=auto")
    assert engines(half.url, tok, dtype="bfloat16").served_dtype == "bfloat16"
    full = server()
    mixed = engines(f"{full.url},{half.url}", tok)
    assert mixed.served_dtype == "bfloat16, float32" and mixed._wire_dtype() is None
    assert mixed.take_warnings() == [f"the SGLang servers serve different dtypes: {full.url} "
                                     f"float32, {half.url} bfloat16"]
    # a float32 server goes away and comes back at bfloat16: not with a float32 run
    other = server()
    eng = engines(f"{full.url},{other.url}", tok, dtype="float32", rejoin_backoff_s=0.1)
    port = other.port
    other.close()
    eng.generate([Sample(ids(tok, "[1,2]="), SamplingParams(max_new_tokens=8)) for _ in range(4)])
    assert eng.servers[1].down
    server(port=port, dtype=torch.bfloat16)
    eng.take_warnings()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        eng.step()
        time.sleep(0.05)
    assert eng.servers[1].down
    assert eng.take_warnings() == [
        f"SGLang server {other.url} answers again but stays out of service: rollout.dtype=float32 "
        f"but SGLang server {other.url} serves bfloat16 (its --dtype); start it with --dtype "
        "float32 or set rollout.dtype=auto"]   # once, however often it is probed


@pytest.mark.parametrize("info,config,dtype", [
    ({"dtype": "bfloat16"}, None, "bfloat16"),
    ({"dtype": "half"}, None, "float16"),
    ({"server_args": {"dtype": "float"}}, None, "float32"),
    ({"dtype": "auto"}, {"dtype": "float32", "model_type": "llama"}, "float16"),   # SGLang's rule
    ({"dtype": "auto"}, {"torch_dtype": "float32", "model_type": "gemma2"}, "bfloat16"),
    ({"dtype": "auto"}, {"torch_dtype": "bfloat16"}, "bfloat16"),
    ({"dtype": "auto"}, None, None),                   # the model's config.json is not readable
    ({"tp_size": 1}, None, None),
])
def test_a_servers_dtype_from_its_server_info(tmp_path, info, config, dtype):
    from trainer.engine.sglang.precision import dtype_from_info, explicit

    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    assert dtype_from_info({**info, "model_path": str(tmp_path)}) == dtype
    # weights are cast only to a dtype the server names itself, never to one resolved from auto
    assert explicit(info) == (dtype is not None and info.get("dtype") != "auto")


def test_an_unknown_server_dtype_is_refused_only_for_an_explicit_rollout_dtype(builtin, tmp_path):
    _, tok = builtin
    srv = _RawServer(lambda line: _http(200, b'{"dtype": "auto", "model_path": "/nowhere"}')
                     if line.startswith("GET /server_info") else _http(200))
    try:
        eng = SGLangEngine(srv.url, eos_token_ids=[tok.eos_token_id])
        assert eng.served_dtype == "unknown"
        eng.close()
        with pytest.raises(EngineError) as e:
            SGLangEngine(srv.url, eos_token_ids=[tok.eos_token_id], dtype="bfloat16")
        assert str(e.value) == (f"rollout.dtype=bfloat16 but the dtype of SGLang server {srv.url} "
                                "is unknown (its /server_info does not name a dtype); start it "
                                "with --dtype bfloat16 or set rollout.dtype=auto")
    finally:
        srv.close()
