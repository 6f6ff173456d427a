"""`engine.prompt_cache_tokens` reaches the embedded engine, bad values are refused by name, and
a run reports the engine's prefill calls and shared prefill tokens."""
import pytest
import torch

from trainer import config as C
from trainer.engine.base import Sample, SamplingParams
from trainer.engine.embedded import EmbeddedEngine
from trainer.models.loading import load_model, load_tokenizer
from trainer.observe import metric_names
from trainer.observe.metrics import MemorySink
from trainer.run.engines import build_engine
from trainer.run.runner import Runner

TINY = ["rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4",
        "rollout.max_response_len=16", "rollout.max_slots=4", "run.reward_workers=0",
        "model.threads=1", "run.checkpoint_every=0", "run.eval_every=0", "run.max_steps=1"]


@pytest.fixture(scope="module")
def builtin():
    model = load_model("builtin", torch.device("cpu"), torch.float32).eval()
    return model, load_tokenizer("builtin")


def engine(builtin, *overrides: str) -> EmbeddedEngine:
    model, tok = builtin
    eng = build_engine(C.load("demo", list(overrides)), model, tok, torch.device("cpu"),
                       torch.float32, 64)
    assert isinstance(eng, EmbeddedEngine)
    return eng


def a_group_of_three(builtin, eng: EmbeddedEngine) -> None:
    """Three samples of one prompt in one slot: each admitted after the last one finished, so
    only the prompt cache (no running sibling) can lend the prompt."""
    model, tok = builtin
    assert eng.max_slots == 1
    prompt = tok("[2,7,1,8]=").input_ids
    eng.generate([Sample(prompt, SamplingParams(temperature=1.0, max_new_tokens=3))
                  for _ in range(3)])


def test_the_default_bound_is_eight_sequences(builtin):
    eng = engine(builtin)
    assert eng.prompts.max_tokens == 8 * 64


def test_a_set_bound_reaches_the_engine_and_zero_turns_the_cache_off(builtin):
    model, tok = builtin
    ctx = len(tok("[2,7,1,8]=").input_ids) - 1
    on = engine(builtin, "rollout.max_slots=1", "engine.prompt_cache_tokens=100")
    assert on.prompts.max_tokens == 100
    a_group_of_three(builtin, on)
    assert len(on.prompts) == 1 and on.stats.prefill_shared_tokens == 2 * ctx   # guard
    off = engine(builtin, "rollout.max_slots=1", "engine.prompt_cache_tokens=0")
    assert off.prompts.max_tokens == 0
    a_group_of_three(builtin, off)
    assert len(off.prompts) == 0 and off.stats.prefill_shared_tokens == 0
    assert off.stats.prefill_calls == 3 and off.stats.prefill_tokens == 3 * ctx


@pytest.mark.slow
@pytest.mark.parametrize("bound, shared", [(-1, 2), (0, 0)])
def test_the_bound_reaches_a_generation_process(builtin, bound, shared):
    """cluster.gen_procs=1: the child's engine caches the prompt or not, as its parent says."""
    model, tok = builtin
    eng = build_engine(C.load("demo", ["rollout.max_slots=1", "cluster.gen_procs=1",
                                       f"engine.prompt_cache_tokens={bound}"]),
                       model, tok, torch.device("cpu"), torch.float32, 64)
    try:
        assert not isinstance(eng, EmbeddedEngine)   # a pool of one generation process
        prompt = tok("[2,7,1,8]=").input_ids
        eng.generate([Sample(prompt, SamplingParams(temperature=1.0, max_new_tokens=3))
                      for _ in range(3)])
        assert eng.stats.generated_tokens == 9   # guard: the child's stats came back
        assert eng.stats.prefill_shared_tokens == shared * (len(prompt) - 1)
    finally:
        eng.close()


@pytest.mark.parametrize("value", ["-2", "lots", "2.5"])
def test_a_bad_bound_is_refused_by_name(value):
    with pytest.raises(C.ConfigError) as e:
        C.apply_overrides(C.Config(), [f"engine.prompt_cache_tokens={value}"])
    assert "an integer in [-1, " in e.value.errors["engine.prompt_cache_tokens"]


@pytest.mark.slow
def test_a_demo_run_reports_prefill_calls_and_shared_tokens(tmp_path):
    sink = MemorySink()
    with Runner(C.load("demo", TINY), tmp_path, sink=sink, system_telemetry=False) as r:
        r.run()
    rows = [row for row in sink.steps if "engine/prefill_calls" in row]
    assert rows, "no step reported engine/prefill_calls"
    assert all(metric_names.declared(k) for k in ("engine/prefill_calls",
                                                  "engine/prefill_shared_tokens"))
    # 2 prompts x 4 samples: each prompt prefilled once, copied to the other samples
    assert sum(row["engine/prefill_calls"] for row in rows) >= 1
    assert sum(row["engine/prefill_shared_tokens"] for row in rows) > 0
