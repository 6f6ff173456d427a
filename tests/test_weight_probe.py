"""The probe of the weights each sync sent (trainer/invariants/probe.py): every generator's
log-probabilities of a fixed sequence against the trainer's. Pure judging, each engine's
`probe_logprobs` against a plain forward pass, and real runs whose weight sync silently fails."""

import pytest
import torch
from fakes.sglang_standin import StandinServer
from helpers import new_weights

from trainer import config as C
from trainer.cli.main import main
from trainer.engine.base import EngineError
from trainer.engine.embedded import EmbeddedEngine
from trainer.engine.pool import EnginePool
from trainer.engine.process import ProcessEngine
from trainer.engine.sglang import SGLangEngine
from trainer.engine.sglang.replies import input_logprobs
from trainer.invariants import RULES, probe
from trainer.models.loading import load_model, load_tokenizer
from trainer.models.lora import LORA_A, LORA_B
from trainer.observe.metrics import JsonlSink, MemorySink, MultiSink
from trainer.run.runner import STOPPED, Runner

TINY = ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
        "rollout.max_response_len=32", "rollout.max_slots=16", "run.reward_workers=0",
        "model.threads=1", "run.eval_every=0", "run.log_samples=0", "run.checkpoint_every=0"]
LORA = ["lora.rank=4", "lora.alpha=8"]


@pytest.fixture(scope="module")
def builtin():
    return load_model("builtin", torch.device("cpu"), torch.float32).eval(), load_tokenizer("builtin")


def reference(model, ids):
    """log p(ids[t] | ids[:t]) from one plain forward pass of `model`."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return logp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


# --- judging (pure) -------------------------------------------------------------------------------

def test_a_generator_within_the_band_holds_and_one_beyond_it_breaks():
    trainer = [-1.0, -2.0, -0.5, -3.0]
    got = probe.judge({"a": [-1.0, -2.0, -0.5, -3.0001], "b": [-1.2, -2.3, -0.4, -3.0]}, trainer,
                      band=5e-4)
    assert got.broken == ["b"] and got.dlogp["a"] == pytest.approx(2.5e-5)
    assert got.dlogp["b"] == pytest.approx(0.15) and got.dlogp_max["b"] == pytest.approx(0.3)
    f = got.figures()
    assert f["invariants/weights_not_applied"] == 1.0 and f["invariants/probe_band"] == 5e-4
    assert f["invariants/probe_dlogp"] == pytest.approx(0.15)
    assert f["invariants/probe_max_dlogp"] == pytest.approx(0.3)
    assert "b: mean |delta log p| 0.15 > band 0.0005" in got.detail()
    assert "invariants/probe_adapter_dlogp" not in f   # no LoRA: no claim about adapters
    healthy = probe.judge({"a": trainer}, trainer, band=5e-4)
    assert not healthy.broken and healthy.detail() == ""
    assert healthy.figures()["invariants/weights_not_applied"] == 0.0


def test_lora_a_generator_on_the_base_is_named_and_the_adapters_shown_only_once_they_moved():
    base, adapted = [-1.0, -2.0, -3.0], [-1.1, -1.8, -3.1]
    got = probe.judge({"on base": list(base), "adapted": list(adapted)}, adapted, 5e-4, base=base)
    assert got.broken == ["on base"] and got.base_like == ["on base"]
    assert got.adapter_gap == pytest.approx(0.4 / 3)
    assert "LoRA's adapters did not reach it" in got.detail()
    assert not got.adapters_shown   # a generator is broken
    assert probe.judge({"adapted": adapted}, adapted, 5e-4, base=base).adapters_shown
    # adapters that have not moved the probe past the band (B = 0 at the start): no claim
    assert not probe.judge({"x": base}, base, 5e-4, base=base).adapters_shown


def test_the_band_is_the_coarser_precision_s():
    assert probe.band("float32", "float32") == probe.BANDS["float32"]
    assert probe.band("bfloat16", "torch.float32") == probe.BANDS["bfloat16"]
    assert probe.band("torch.float32", torch.bfloat16) == probe.BANDS["bfloat16"]
    with pytest.raises(ValueError, match="no probe band for dtype 'int8'"):
        probe.band("int8", "float32")
    with pytest.raises(ValueError, match="band must be > 0"):
        probe.judge({}, [0.0], 0.0)
    with pytest.raises(ValueError, match="3 and 2 tokens cannot be compared"):
        probe.judge({"a": [0.0, 0.0, 0.0]}, [0.0, 0.0], 1e-3)


def test_the_probe_sequence_is_the_tokenizer_s_own_text(builtin):
    _, tok = builtin
    ids = probe.probe_tokens(tok)
    assert len(ids) == probe.PROBE_TOKENS and tok.decode(ids) == probe.PROBE_TEXT[:len(ids)]
    assert probe.probe_tokens(tok, 5) == ids[:5]
    assert probe.RULE in RULES   # reported, alerted and audited like every rule


# --- each engine scores the probe with the weights it holds ---------------------------------------

def test_embedded_engine_scores_as_a_plain_forward_pass_and_follows_its_weights(builtin):
    model, tok = builtin
    ids = probe.probe_tokens(tok)
    eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=2, max_seq_len=64)
    (got,) = eng.probe_logprobs(ids).values()
    assert torch.allclose(torch.tensor(got), reference(model, ids), atol=1e-5)
    other = new_weights(model)
    eng.update_weights(other.state_dict(), version=1)
    (after,) = eng.probe_logprobs(ids).values()
    assert torch.allclose(torch.tensor(after), reference(other, ids), atol=1e-5)
    assert probe.mean_abs_diff(after, got) > probe.BANDS["float32"]   # the probe sees new weights


def test_generation_processes_each_score_with_their_own_weights(builtin):
    model, tok = builtin
    ids = probe.probe_tokens(tok)

    def member(index, seed, weights):
        return ProcessEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=2,
                             max_seq_len=64, seed=seed, weights=weights)

    pool = EnginePool(member, 2, backoff_s=0.1)
    try:
        got = pool.probe_logprobs(ids)
        assert sorted(got) == ["member 0", "member 1"]
        for lp in got.values():
            assert torch.allclose(torch.tensor(lp), reference(model, ids), atol=1e-5)
        other = new_weights(model)
        pool.update_weights(other.state_dict(), version=1)
        for lp in pool.probe_logprobs(ids).values():
            assert torch.allclose(torch.tensor(lp), reference(other, ids), atol=1e-5)
    finally:
        pool.close()


def test_sglang_servers_score_the_probe_from_input_token_logprobs(builtin):
    model, tok = builtin
    ids = probe.probe_tokens(tok)
    servers = [StandinServer(model, tok, eos_token_ids=[tok.eos_token_id], max_slots=4,
                             max_seq_len=200).start() for _ in range(2)]
    eng = SGLangEngine(",".join(s.url for s in servers), eos_token_ids=[tok.eos_token_id],
                       model_config=model.config, retries=1, backoff_s=0.05)
    try:
        got = eng.probe_logprobs(ids)
        assert sorted(got) == sorted(s.url for s in servers)
        for lp in got.values():
            assert torch.allclose(torch.tensor(lp), reference(model, ids), atol=1e-5)
        servers[1].fail_next(1, status=400)   # a server refusing the probe: left out, said
        assert list(eng.probe_logprobs(ids)) == [servers[0].url]
        assert any("weight probe left" in w and servers[1].url in w for w in eng.take_warnings())
    finally:
        eng.close()
        for s in servers:
            s.close()


def test_a_reply_without_input_logprobs_is_a_clear_error():
    with pytest.raises(EngineError, match="no meta_info.input_token_logprobs"):
        input_logprobs({"meta_info": {}}, 4, "http://x")
    short = {"meta_info": {"input_token_logprobs": [[None, 1, None], [-0.5, 2, None]]}}
    with pytest.raises(EngineError, match="1 input log-probabilities for 4 input tokens"):
        input_logprobs(short, 4, "http://x")
    full = {"meta_info": {"input_token_logprobs": [[None, 1, None], [-0.5, 2, None], [-1, 3, None]]}}
    assert input_logprobs(full, 3, "http://x") == [-0.5, -1.0]


# --- real runs ------------------------------------------------------------------------------------

def silently_failing(monkeypatch, keep=None):
    """The embedded engine's weight update reports success and loads nothing (`keep`: loads the
    tensors whose name it keeps, the rest silently dropped)."""
    real = EmbeddedEngine.update_weights

    def update(self, named_tensors, version, recompute_kv=False):
        if keep is None:
            self.version = version
            return
        items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
        real(self, {k: v for k, v in items if keep(k)}, version, recompute_kv)

    monkeypatch.setattr(EmbeddedEngine, "update_weights", update)


@pytest.mark.slow
def test_a_healthy_run_probes_each_sync_and_reports_zeros(tmp_path):
    sink = MemorySink()
    cfg = C.load("demo", TINY + ["run.max_steps=3"])
    with Runner(cfg, tmp_path, sink=MultiSink([sink, JsonlSink(tmp_path)])) as r:
        r.run()
    assert sink.series("invariants/weights_not_applied") == [0.0, 0.0, 0.0]
    assert all(d <= probe.BANDS["float32"] for d in sink.series("invariants/probe_dlogp"))
    assert len(sink.series("timing/probe_s")) == 3   # the probe ran after each sync
    assert not [e for e in sink.events if e["kind"] in ("invariant_violated", "warning")]
    assert main(["check", str(tmp_path)]) == 0


@pytest.mark.slow
def test_a_sync_that_silently_loads_nothing_is_caught_and_stops_the_run(tmp_path, monkeypatch):
    silently_failing(monkeypatch)
    sink = MemorySink()
    cfg = C.load("demo", TINY + ["run.max_steps=6", "run.stop_on_violation=true"])
    with Runner(cfg, tmp_path, sink=MultiSink([sink, JsonlSink(tmp_path)])) as r:
        assert r.run() == STOPPED
        stopped_at = r.step
    (event,) = [e for e in sink.events if e["kind"] == "invariant_violated"]
    assert event["rule"] == "weights_not_applied" and event["step"] == stopped_at
    assert event["samples"] == ["embedded"] and "mean |delta log p|" in event["detail"]
    assert sink.series("invariants/weights_not_applied")[-1] == 1.0
    assert sink.series("invariants/probe_dlogp")[-1] > probe.BANDS["float32"]
    # the tokens still carry the version sent: the sample rules see nothing wrong
    assert sum(sink.series("invariants/beyond_span")) == 0
    (stop,) = [e for e in sink.events if e["kind"] == "stop_requested"]
    assert stop["reason"]["rule"] == "weights_not_applied"
    assert main(["check", str(tmp_path)]) == 1


@pytest.mark.slow
def test_lora_an_engine_that_gets_the_base_but_not_the_adapters_is_caught(tmp_path, monkeypatch):
    silently_failing(monkeypatch, keep=lambda name: not name.endswith((LORA_A, LORA_B)))
    sink = MemorySink()
    cfg = C.load("demo", TINY + LORA + ["run.max_steps=4"])
    with Runner(cfg, tmp_path, sink=sink) as r:
        r.run()
    broken = [e for e in sink.events if e["kind"] == "invariant_violated"]
    assert broken and {e["rule"] for e in broken} == {"weights_not_applied"}
    assert "LoRA's adapters did not reach it" in broken[-1]["detail"]
    assert sink.series("invariants/probe_adapters_shown")[-1] == 0.0
    gaps = sink.series("invariants/probe_adapter_dlogp")
    assert gaps[-1] > probe.BANDS["float32"]   # the adapters moved the probe: it can tell


@pytest.mark.slow
def test_lora_healthy_the_adapters_are_shown_applied(tmp_path):
    sink = MemorySink()
    cfg = C.load("demo", TINY + LORA + ["run.max_steps=4"])
    with Runner(cfg, tmp_path, sink=sink) as r:
        r.run()
    assert sink.series("invariants/weights_not_applied") == [0.0] * 4
    gaps, d = sink.series("invariants/probe_adapter_dlogp"), sink.series("invariants/probe_dlogp")
    assert gaps[-1] > probe.BANDS["float32"] >= d[-1]   # adapted, and the engine has them
    assert sink.series("invariants/probe_adapters_shown")[-1] == 1.0


@pytest.mark.slow
def test_generation_processes_one_member_s_silently_failed_sync_is_named(tmp_path, monkeypatch):
    """cluster.gen_procs = 2: the second member's updates reach nothing (its child keeps its
    weights); the probe names that member and no other."""
    real = ProcessEngine.update_weights
    calls = []

    def update(self, named_tensors, version, recompute_kv=False):
        calls.append(version)
        if len(calls) % 2 == 0:   # the pool updates its members in order: member 1's
            return
        real(self, named_tensors, version, recompute_kv)

    monkeypatch.setattr(ProcessEngine, "update_weights", update)
    sink = MemorySink()
    cfg = C.load("demo", TINY + ["run.max_steps=4", "cluster.gen_procs=2"])
    with Runner(cfg, tmp_path, sink=sink) as r:
        r.run()
    assert len(calls) == 8   # two members, four syncs: the path was exercised
    probed = [e for e in sink.events if e["kind"] == "invariant_violated"
              and e["rule"] == "weights_not_applied"]
    assert probed and all(e["samples"] == ["member 1"] for e in probed)
    assert max(sink.series("invariants/weights_not_applied")) == 1.0


@pytest.mark.slow
def test_an_asynchronous_run_probes_its_worker_s_engine(tmp_path):
    sink = MemorySink()
    cfg = C.load("async", TINY + ["run.max_steps=3"])
    with Runner(cfg, tmp_path, sink=sink) as r:
        r.run()
    assert sink.series("invariants/weights_not_applied") == [0.0, 0.0, 0.0]
    assert len(sink.series("timing/probe_s")) == 3
    assert not [e for e in sink.events if e["kind"] == "warning" and "probe" in e["message"]]
