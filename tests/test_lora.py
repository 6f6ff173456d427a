"""LoRA (trainer/models/lora.py): one learner step is the low-rank update computed by hand; the
KL reference is the base model exactly; the engines decode the merged weights; a run
checkpoints its adapters, resumes bit for bit, forks, and exports an adapter and a merged model
that transformers and PEFT reload and decode the same greedy tokens as the run's engine."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import TINY_RUN, full_forward_logprobs

from trainer import config as C
from trainer.algo.learner import Learner, TrainSequence
from trainer.cli.export import ExportError, export
from trainer.engine.base import Sample, SamplingParams
from trainer.engine.embedded import EmbeddedEngine
from trainer.models import lora
from trainer.models.loading import load_model, load_tokenizer
from trainer.observe.metrics import MemorySink
from trainer.run.runner import Runner

CPU = torch.device("cpu")
PROMPTS = ["[3,5]=", "[1,2,3,4,5]=", "[9,9]=", "[4,4,4,4]="]


def adapted_builtin(rank=2, alpha=4.0, targets="q_proj,v_proj", seed=0):
    cfg = C.load("demo", [f"lora.rank={rank}", f"lora.alpha={alpha}",
                          f"lora.target_modules={targets}"])
    model = lora.wrap(load_model("builtin", CPU, torch.float32), cfg)
    torch.manual_seed(seed)
    with torch.no_grad():   # B starts at zero (the base exactly): give both factors a value
        for _, layer in lora._lora_layers(model):
            layer.lora_B[lora.ADAPTER].weight.normal_(0, 0.05)
    return model.eval()


def sequences(tok, model):
    """Two sequences whose old log-probabilities are the policy's own (importance ratio 1)."""
    seqs = []
    for text, completion, adv in (("[3,5]=", "8]", 1.0), ("[1,2]=", "4]", -0.5)):
        p, r = tok(text).input_ids, tok(completion, add_special_tokens=False).input_ids
        s = Sample(p, SamplingParams(temperature=1.0))
        s.response_ids = r
        old = full_forward_logprobs(model, s).tolist()
        seqs.append(TrainSequence(p, r, old, adv, 1.0))
    return seqs


def test_one_step_is_the_low_rank_update_computed_by_hand():
    tok = load_tokenizer("builtin")
    model = adapted_builtin()
    base_before = {n: t.clone() for n, t in model.state_dict().items() if "lora_" not in n}
    layers = dict(lora._lora_layers(model))
    factors = {n: (layer.lora_A[lora.ADAPTER].weight.detach().clone(),
                   layer.lora_B[lora.ADAPTER].weight.detach().clone(), layer.scaling[lora.ADAPTER])
               for n, layer in layers.items()}
    seqs = sequences(tok, model)

    # by hand: the gradient of the GRPO loss (ratio 1: -A * logp, token mean) with respect to
    # each merged weight W' = W + s B A of a plain model, then the chain rule onto A and B
    plain = lora.merged_copy(model).requires_grad_(True)
    total = sum(len(s.response_ids) for s in seqs)
    loss = 0.0
    for s in seqs:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logp = torch.log_softmax(plain(ids).logits[0].float(), -1)[len(s.prompt_ids) - 1:-1]
        logp = logp.gather(1, torch.tensor(s.response_ids).unsqueeze(1))
        loss = loss - s.advantage * logp.sum() / total
    loss.backward()
    modules = dict(plain.named_modules())

    lr, eps = 1e-3, 1e-8
    learner = Learner(model, lr=lr, weight_decay=0.0, track_reference=False)
    assert {id(p) for g in learner.optimizer.param_groups for p in g["params"]} == {
        id(p) for n, p in model.named_parameters() if "lora_" in n}   # the adapters alone
    learner.update(seqs, pad_id=tok.pad_token_id, lr=lr, grad_clip=0.0, clip_low=0.2,
                   clip_high=0.2, kl_coef=0.0, micro_batch_tokens=4096)

    checked = 0
    for name, layer in layers.items():
        A, B, s = factors[name]
        G = modules[lora._plain(name)].weight.grad                # dL/dW'
        want_gA, want_gB = s * B.T @ G, s * G @ A.T               # dW'/dA = s B, dW'/dB = s A
        got_A, got_B = layer.lora_A[lora.ADAPTER].weight, layer.lora_B[lora.ADAPTER].weight
        for got, want in ((got_A.grad, want_gA), (got_B.grad, want_gB)):   # float32 sums
            assert want.abs().max() > 1e-4
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4 * want.abs().max().item())
        # AdamW's first step (bias-corrected, no decay): p - lr * g / (|g| + eps)
        for before, after, g in ((A, got_A, got_A.grad), (B, got_B, got_B.grad)):
            torch.testing.assert_close(after.detach(), before - lr * g / (g.abs() + eps),
                                       rtol=0, atol=1e-7)
        assert not torch.equal(got_A.detach(), A) and not torch.equal(got_B.detach(), B)
        checked += 1
    assert checked == 2 * 4   # q_proj and v_proj of the built-in model's 4 layers
    for n, t in model.state_dict().items():   # the base weights: bit-identical
        if "lora_" not in n:
            assert torch.equal(t, base_before[n]), n


def test_the_reference_is_the_base_model_exactly():
    tok = load_tokenizer("builtin")
    model = adapted_builtin()
    learner = Learner(model, lr=1e-3, weight_decay=0.0, track_reference=True)
    assert learner.reference is None   # no copy: the adapters switched off
    seqs = sequences(tok, model)
    base = load_model("builtin", CPU, torch.float32).eval()
    want = learner.logprobs(seqs, tok.pad_token_id, 4096, reference=False)
    ref = learner.logprobs(seqs, tok.pad_token_id, 4096, reference=True)
    plain = Learner(base, lr=1e-3, weight_decay=0.0, track_reference=False)
    assert ref == plain.logprobs(seqs, tok.pad_token_id, 4096)   # exactly
    assert ref != want   # the guard: the adapters do change the policy
    # the adapters are on again afterwards
    assert learner.logprobs(seqs, tok.pad_token_id, 4096) == want


def test_the_engine_decodes_the_base_plus_the_factors_it_is_sent():
    tok = load_tokenizer("builtin")
    model = adapted_builtin(targets="all-linear")
    whole = lora.merged_weights(model)   # what SGLang gets, and the exports
    assert set(whole) == set(load_model("builtin", CPU, torch.float32).state_dict())
    merged = EmbeddedEngine(lora.merged_copy(model), eos_token_ids=[tok.eos_token_id],
                            max_slots=4, max_seq_len=128)
    _decodes_the_policy(merged, tok, model)
    # the embedded engine holds the base and merges the factors: W + (alpha/r B) A
    served = lora.base_copy(model)
    assert not lora.is_adapted(served) and "lora" not in str(served)
    eng = EmbeddedEngine(served, eos_token_ids=[tok.eos_token_id], max_slots=4, max_seq_len=128)
    factors = lora.adapter_update(model)
    assert len(factors) == 2 * 7 * 4   # all-linear: 7 layers of 4 blocks, A and B each
    eng.update_weights(factors, 1)
    _decodes_the_policy(eng, tok, model)
    factor_bytes = sum(t.numel() * 4 for t in factors.values())
    assert eng.last_sync_bytes == factor_bytes
    assert factor_bytes * 10 < sum(t.numel() * 4 for t in whole.values())   # r = 2: tiny
    # the next update merges onto the base, not onto the last merge
    with torch.no_grad():
        for _, layer in lora._lora_layers(model):
            layer.lora_B[lora.ADAPTER].weight.mul_(3.0)
    eng.update_weights(lora.adapter_update(model), 2)
    _decodes_the_policy(eng, tok, model)


def _decodes_the_policy(eng, tok, model):
    """The engine's log-probabilities are the adapted model's plain forward pass's."""
    ss = [Sample(tok(t).input_ids, SamplingParams(temperature=1.0, max_new_tokens=24))
          for t in PROMPTS]
    eng.generate(ss)
    for s in ss:
        torch.testing.assert_close(torch.tensor(s.logprobs), full_forward_logprobs(model, s),
                                   rtol=0, atol=2e-4)


LORA = ["lora.rank=4", "lora.alpha=8", "optim.lr=2e-3", "algo.track_kl=true"]


def _run(run_dir, overrides, steps, **kw):
    cfg = C.load("demo", TINY_RUN + LORA + overrides + [f"run.max_steps={steps}"])
    sink = MemorySink()
    runner = Runner(cfg, run_dir, sink=sink, system_telemetry=False, **kw)
    with runner:
        runner.run()
    runner.memory = sink
    return runner


def _adapters(model):
    return {n: t.clone() for n, t in lora.adapter_weights(model).items()}


def test_a_lora_run_checkpoints_its_adapters_resumes_exactly_forks_and_exports(tmp_path):
    first = _run(tmp_path / "run", ["run.checkpoint_every=2"], steps=2)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002" / "model"
    assert (ckpt / "adapter_model.safetensors").is_file()
    assert not (ckpt / "model.safetensors").exists()   # the adapters, not the model
    assert lora.is_adapted(first.model)
    sync = first.memory.steps[-1]["perf/weight_sync_bytes"]
    # the adapters' factors, which the engine merges: the adapter's size, not the model's
    assert sync == sum(t.numel() * t.element_size() for t in lora.adapter_update(first.model).values())
    assert sync * 10 < sum(t.numel() * t.element_size() for t in lora.merged_weights(first.model).values())

    straight = _run(tmp_path / "straight", [], steps=3)
    kls = [r["actor/kl"] for r in straight.memory.steps]
    # against the base (adapters off): exactly 0 while B is still its initial zeros, then not
    assert kls[0] == 0.0 and max(kls) > 0, kls
    shutil.copytree(tmp_path / "run", tmp_path / "resumed")
    resumed = _run(tmp_path / "resumed", [], steps=3, resume=True)
    a, b = _adapters(straight.model), _adapters(resumed.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.totals == straight.totals

    # carrying the adapters into another shape (a fork, a resume with --set) is refused by name
    from trainer.run.fork import fork_run_dir

    for key in ("lora.rank=8", "lora.target_modules=q_proj", "lora.alpha=1"):
        with pytest.raises(C.ConfigError, match=key.split("=")[0]):
            fork_run_dir(tmp_path / "run", 2, tmp_path / "bad", [key, "run.max_steps=5"])

    # export: the adapter (PEFT) and the merged model (transformers) decode the engine's tokens
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    export(tmp_path / "run", tmp_path / "adapter", adapter=True)
    export(tmp_path / "run", tmp_path / "merged", adapter=False)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4
    tok = load_tokenizer("builtin")
    via_peft = PeftModel.from_pretrained(load_model("builtin", CPU, torch.float32),
                                         str(tmp_path / "adapter")).eval()
    via_hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    resumed_at_2 = lora.load(load_model("builtin", CPU, torch.float32), ckpt, trainable=False)
    eng = EmbeddedEngine(lora.merged_copy(resumed_at_2), eos_token_ids=[tok.eos_token_id],
                         max_slots=4, max_seq_len=128)
    for text in PROMPTS:
        s = Sample(tok(text).input_ids, SamplingParams(temperature=0.0, max_new_tokens=16))
        eng.generate([s])
        ids = torch.tensor([s.prompt_ids])
        for m in (via_peft, via_hf):
            out = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=16, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)[0, len(s.prompt_ids):].tolist()
            assert out == s.response_ids, (text, type(m).__name__)

    with pytest.raises(ExportError, match="not empty"):
        export(tmp_path / "run", tmp_path / "merged", adapter=False)

    # a fork with another learning rate continues from the adapters
    from trainer.run.fork import parent_config

    fork_run_dir(tmp_path / "run", 2, tmp_path / "fork", ["optim.lr=5e-3", "run.max_steps=6"])
    sink = MemorySink()
    forked = Runner(parent_config(tmp_path / "fork"), tmp_path / "fork", sink=sink,
                    system_telemetry=False, resume=True)
    with forked:
        forked.run()
    assert forked.step == 6 and forked.cfg.optim.lr == 5e-3 and lora.is_adapted(forked.model)
    assert any(r.get("actor/loss_tokens") for r in sink.steps)   # the guard: it trained
    resumed_from = _adapters(lora.load(load_model("builtin", CPU, torch.float32), ckpt))
    assert not all(torch.equal(resumed_from[k], v) for k, v in _adapters(forked.model).items())


def test_bad_lora_settings_are_refused_by_name(tmp_path):
    with pytest.raises(C.ConfigError, match="lora.target_modules"):
        C.load("demo", ["lora.rank=4", "lora.target_modules= , "])
    with pytest.raises(C.ConfigError, match="lora.alpha"):
        C.load("demo", ["lora.rank=4", "lora.alpha=0"])
    with pytest.raises(ValueError, match="lora.target_modules='nope_proj'"):
        lora.wrap(load_model("builtin", CPU, torch.float32),
                  C.load("demo", ["lora.rank=4", "lora.target_modules=nope_proj"]))
    first = _run(tmp_path / "full", ["lora.rank=0", "run.checkpoint_every=1"], steps=1)
    assert not lora.is_adapted(first.model)
    with pytest.raises(ExportError, match="no adapter"):
        export(tmp_path / "full", tmp_path / "x", adapter=True)


@pytest.mark.parametrize("preset,extra", [
    ("april", ["april.segment_max_tokens=12"]),
    ("greso", []),
    ("async", []),
    ("demo", ["cluster.gen_procs=1"]),   # the process pool: the adapted layers cross to the child
    ("all", ["april.segment_max_tokens=16", "cluster.gen_procs=2"]),
])
def test_every_technique_and_engine_layout_trains_the_adapters(tmp_path, preset, extra):
    cfg = C.load(preset, TINY_RUN + LORA + extra + ["run.max_steps=4"])
    sink = MemorySink()
    with Runner(cfg, tmp_path, sink=sink, system_telemetry=False) as runner:
        runner.run()
    assert runner.step == 4 and lora.is_adapted(runner.model)
    assert sum(r["rollout/trained_tokens"] for r in sink.steps) > 0   # the guard: it trained
    factors = sum(t.numel() * t.element_size() for t in lora.adapter_update(runner.model).values())
    # what reached the engine each update: the adapters' factors, not the model (a pool reports
    # its children's copies: one each)
    members = max(1, cfg.cluster.gen_procs)
    assert {r["perf/weight_sync_bytes"] for r in sink.steps} == {factors * members}
    # B starts at zeros (the policy is the base): the updates moved it
    assert any(t.abs().max() > 0 for k, t in _adapters(runner.model).items() if "lora_B" in k)


def _dropouts(model) -> list[float]:
    """Each adapted layer's dropout as it runs (PEFT: Identity for 0), and the config's."""
    return ([getattr(layer.lora_dropout[lora.ADAPTER], "p", 0.0) for _, layer in lora._lora_layers(model)]
            + [model.peft_config[lora.ADAPTER].lora_dropout])


def test_a_dropout_change_at_resume_or_fork_takes_effect_and_is_recorded(tmp_path):
    """The checkpoint's adapter_config.json says the dropout it was written with; PEFT's load
    keeps that one. The resumed or forked run's `lora.dropout` is the one that trains, and its
    next checkpoint records it."""
    from trainer.run.fork import fork_run_dir, parent_config

    _run(tmp_path / "run", ["run.checkpoint_every=2", "lora.dropout=0.2"], steps=2)
    fork_run_dir(tmp_path / "run", 2, tmp_path / "fork", ["lora.dropout=0", "run.max_steps=4"])
    forked = Runner(parent_config(tmp_path / "fork"), tmp_path / "fork", sink=MemorySink(),
                    system_telemetry=False, resume=True)
    with forked:
        assert set(_dropouts(forked.model)) == {0.0}
        assert lora.dropout(forked.model) == 0.0
    cfg = C.load("demo", TINY_RUN + LORA + ["lora.dropout=0.5", "run.max_steps=4",
                                            "run.checkpoint_every=4"])
    resumed = Runner(cfg, tmp_path / "run", sink=MemorySink(), system_telemetry=False, resume=True)
    with resumed:
        assert set(_dropouts(resumed.model)) == {0.5}
        resumed.run()
    saved = tmp_path / "run" / "checkpoints" / "step_000004" / "model" / "adapter_config.json"
    assert json.loads(saved.read_text())["lora_dropout"] == 0.5


def test_dropout_above_zero_is_warned_about():
    """pi_theta with dropout against a dropout-free pi_old and engine: the warning says so."""
    on = C.load("demo", ["lora.rank=4", "lora.dropout=0.1"])
    assert "PPO ratio" in lora.dropout_warning(on)
    assert lora.dropout_warning(C.load("demo", ["lora.rank=4"])) is None   # the default: 0
    assert lora.dropout_warning(C.load("demo", ["lora.dropout=0.1"])) is None   # LoRA off
    with pytest.raises(ValueError, match="lora.dropout"):
        lora.set_dropout(adapted_builtin(), 1.0)


# a base weight of scale 0.02 and an adapter delta of 1e-4, below bfloat16's step there (2^-13):
# round(0.01997) = 0.02001953125, and round(0.01997 + 1e-4) = round(0.02007) = 0.02001953125 too;
# adding the delta to the rounded base rounds twice: round(0.02001953125 + 1e-4) = 0.0201416015625
W32, DELTA = 0.01997, 1e-4
ONCE, TWICE = 0.02001953125, 0.0201416015625


def _one_delta(model) -> str:
    """Factors whose product is DELTA at [0, 0] of layer 0's q_proj, zero elsewhere, on a base
    weight of W32 there. Returns the weight's plain name."""
    layer = dict(lora._lora_layers(model))["base_model.model.model.layers.0.self_attn.q_proj"]
    with torch.no_grad():
        for _, other in lora._lora_layers(model):
            other.lora_B[lora.ADAPTER].weight.zero_()
        layer.get_base_layer().weight[0, 0] = W32
        layer.lora_A[lora.ADAPTER].weight.zero_()
        layer.lora_A[lora.ADAPTER].weight[0, 0] = 1.0
        layer.lora_B[lora.ADAPTER].weight[0, 0] = DELTA / layer.scaling[lora.ADAPTER]
    return "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("processes", [0, 1])
def test_a_bfloat16_engine_merges_a_float32_base_and_its_delta_rounding_once(processes):
    """A float32 trainer, a bfloat16 engine: the merged weight is round_bf16(W + delta), as the
    merged model SGLang and the exports get, not round_bf16(round_bf16(W) + delta) from the
    engine's own rounded base. The embedded engine and a generation process alike."""
    from trainer.run import engines

    tok = load_tokenizer("builtin")
    model = adapted_builtin(rank=1, targets="q_proj,v_proj")
    name = _one_delta(model)
    assert torch.tensor(W32 + DELTA).to(torch.bfloat16).item() == ONCE   # the hand values
    assert (torch.tensor(W32).to(torch.bfloat16).float() + DELTA).to(torch.bfloat16).item() == TWICE
    merged = lora.merged_weights(model)[name][0, 0]
    assert merged.to(torch.bfloat16).item() == ONCE
    cfg = C.load("demo", ["lora.rank=1", "lora.target_modules=q_proj,v_proj", "rollout.dtype=bfloat16",
                          f"cluster.gen_procs={processes}"])
    eng = engines.build_engine(cfg, lora.base_copy(model), tok, CPU, torch.float32, 128,
                               adapter=lora.adapter_update(model))
    try:
        if processes:   # the child merges what its shared buffer holds: the float32 base
            shared = eng.members[0].engine.loaded_weights()
            assert shared[name].dtype == torch.float32 and shared[name][0, 0].item() == torch.tensor(W32).item()
            assert (shared[name + lora.LORA_B].float() @ shared[name + lora.LORA_A].float())[0, 0].item() \
                == pytest.approx(DELTA, rel=1e-6)
        else:
            assert eng.decoder.w[name][0, 0].item() == ONCE
            # the next update merges onto the float32 base again, not onto the last merge
            eng.update_weights(lora.adapter_update(model), 1)
            assert eng.decoder.w[name][0, 0].item() == ONCE
    finally:
        eng.close()


def test_the_adapter_size_is_its_files_bytes_counted_without_peft_state_dict():
    """run_started's adapter_bytes: what the adapter file holds (PEFT's state dict), counted from
    the parameters, which a sharded model gives whole without a collective."""
    model = adapted_builtin(rank=4, targets="q_proj,v_proj")
    file_bytes = sum(t.numel() * t.element_size() for t in lora.adapter_weights(model).values())
    sizes = lora.sizes(model)
    assert file_bytes > 0 and sizes["adapter_bytes"] == file_bytes
    assert sizes["trainable_params"] * 4 == file_bytes   # float32 factors, nothing else trains
