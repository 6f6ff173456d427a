"""The embedded engine gives its KV cache back for the training phase and takes it again for
generation, without changing what it generates."""
import pytest
import torch

from trainer.engine.base import Sample, SamplingParams
from trainer.engine.embedded import EmbeddedEngine, slots_from_free_memory
from trainer.models.loading import load_model, load_tokenizer

TEXTS = ["[3,5]=", "[1,2,3,4,5,6,7,8,9,1,2,3]=", "[9]=", "[4,4,4,4]=", "[7,1,8,2,6]="]


@pytest.fixture(scope="module")
def builtin():
    model = load_model("builtin", torch.device("cpu"), torch.float32).eval()
    return model, load_tokenizer("builtin")


def batch(tok, temperature):
    return [Sample(tok(t).input_ids, SamplingParams(temperature=temperature, max_new_tokens=60))
            for t in TEXTS]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_release_and_reacquire_keep_results_identical(builtin, temperature):
    model, tok = builtin

    def engine():
        return EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=3,
                              max_seq_len=200, seed=4)

    plain, cycled = engine(), engine()
    runs = {"plain": [], "cycled": []}
    for _ in range(2):  # two "steps": generate, then (for one engine) train with the cache freed
        a, b = batch(tok, temperature), batch(tok, temperature)
        plain.generate(a)
        cycled.generate(b)
        runs["plain"].append([(s.response_ids, s.logprobs) for s in a])
        runs["cycled"].append([(s.response_ids, s.logprobs) for s in b])
        assert cycled.release_memory() is True and cycled.cache is None
        assert cycled.release_memory() is True  # twice is harmless
        cycled.reacquire_memory()
        assert cycled.cache is not None and cycled.cache.k.shape[1] == 3
        cycled.release_memory()  # the next generate takes it back by itself
    assert runs["plain"] == runs["cycled"]


def test_release_is_refused_while_sequences_run(builtin):
    model, tok = builtin
    eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=2, max_seq_len=200)
    eng.submit(batch(tok, 1.0))
    eng.step()
    with pytest.raises(RuntimeError, match="sequences are running"):
        eng.release_memory()
    parts = eng.abort()
    eng.release_memory()
    assert eng.cache is None
    eng.generate(parts)  # resumes after taking the cache back
    assert all(s.done for s in parts) and eng.cache is not None


def test_slots_from_free_memory(builtin):
    model, tok = builtin
    eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots="auto",
                         max_seq_len=200, kv_memory_fraction=0.01)
    d = eng.decoder
    per_slot = 2 * d.n_layers * d.n_kv * 200 * d.head_dim * 4
    assert 1 <= eng.max_slots <= 1024 and eng.cache.k.shape[1] == eng.max_slots
    assert slots_from_free_memory(d, 200, 1e-12) == 1
    assert slots_from_free_memory(d, 200, 0.5, cap=7) == 7
    assert per_slot == 2 * 4 * 2 * 200 * 32 * 4  # the built-in model: 4 layers, 2 kv heads, d=32
    ss = batch(tok, 0.0)
    eng.generate(ss)
    assert all(s.done for s in ss)


def test_auto_slots_are_capped(builtin):
    model, tok = builtin
    eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots="auto",
                         slots_cap=5, max_seq_len=100)
    assert eng.max_slots == 5
    eng.release_memory()
    eng.reacquire_memory()
    assert eng.max_slots == 5 and eng.cache.k.shape[1] == 5


def test_release_memory_is_part_of_the_engine_interface(builtin):
    """The runner asks every engine (wrapped in stop strings or not); only one that holds the
    trainer's device memory says it freed something."""
    from trainer.engine.base import RolloutEngine
    from trainer.engine.stops import StopStrings
    from trainer.episode.engine import Episodes
    from trainer.episode.environments import Environment
    from trainer.episode.tools import TAG_SYNTAX
    from trainer.episode.turns import TurnFormat

    model, tok = builtin
    eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=2, max_seq_len=64)
    wrapped = StopStrings(eng, tok, ["]"])
    assert wrapped.release_memory() is True and eng.cache is None
    wrapped.reacquire_memory()
    assert eng.cache is not None
    env = Environment(syntax=TAG_SYNTAX, feedback=False, timeout_s=1.0, output_chars=10,
                      verify=lambda kind, answer, text: 0.0)
    episodes = Episodes(wrapped, tok, env, TurnFormat(tok, chat=False), max_turns=2)
    assert episodes.release_memory() is True and eng.cache is None   # two wrappers deep
    episodes.reacquire_memory()
    assert eng.cache is not None
    episodes.close()
    assert RolloutEngine().release_memory() is False   # SGLang servers, the process engine
