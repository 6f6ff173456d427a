"""The embedded engine against a plain forward pass, and its batching/abort/resume contract."""
import pytest
import torch
from helpers import full_forward_logprobs, tiny_hf_model
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from trainer.engine.base import ABORT, SEGMENT, STOP, Sample, SamplingParams
from trainer.engine.embedded import EmbeddedEngine
from trainer.models.loading import load_model, load_tokenizer


@pytest.fixture(scope="module")
def builtin():
    model = load_model("builtin", torch.device("cpu"), torch.float32).eval()
    return model, load_tokenizer("builtin")


def prompts(tok, texts):
    return [tok(t).input_ids for t in texts]


TEXTS = ["[3,5]=", "[1,2,3,4,5,6,7,8,9,1,2,3]=", "[9]=", "[4,4,4,4]=", "[7,1,8,2,6]="]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_plain_forward_pass(builtin, temperature):
    model, tok = builtin
    eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=3, max_seq_len=200,
                         seed=3)
    samples = [Sample(p, SamplingParams(temperature=temperature, max_new_tokens=80))
               for p in prompts(tok, TEXTS * 2)]
    eng.generate(samples)
    for s in samples:
        s.check()
        assert s.response_ids
        ref = full_forward_logprobs(model, s, temperature)
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=1e-4)


def test_a_group_sharing_its_prompt_is_prefilled_once_and_matches_a_forward_pass(builtin):
    model, tok = builtin
    eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=16, max_seq_len=200,
                         seed=4)
    group, other = prompts(tok, ["[1,2,3,4,5,6]=", "[8,8]="])
    samples = [Sample(group, SamplingParams(max_new_tokens=60)) for _ in range(6)]
    samples += [Sample(other, SamplingParams(max_new_tokens=60)) for _ in range(3)]
    eng.generate(samples)
    # each distinct prompt went through the model once, the other 5 + 2 copies were shared
    context = [len(group) - 1, len(other) - 1]
    assert eng.stats.prefill_tokens == sum(context)
    assert eng.stats.prefill_shared_tokens == 5 * context[0] + 2 * context[1]
    assert len({tuple(s.response_ids) for s in samples[:6]}) > 1  # the copies still sample apart
    for s in samples:
        ref = full_forward_logprobs(model, s)
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=1e-4)


def test_a_group_admitted_over_several_steps_borrows_its_prompt_from_a_running_sibling(builtin):
    """Three slots, five samples of one prompt: the later ones take the prompt's KV entries from
    a sibling still running; after a weight update the old entries are never lent."""
    model, tok = builtin
    eng = EmbeddedEngine(model, eos_token_ids=[], max_slots=3, max_seq_len=200, seed=5)
    prompt = prompts(tok, ["[2,7,1,8]="])[0]
    samples = [Sample(prompt, SamplingParams(max_new_tokens=n)) for n in (40, 10, 40, 12, 5)]
    eng.generate(samples)
    assert eng.stats.prefill_tokens == len(prompt) - 1          # computed once
    assert eng.stats.prefill_shared_tokens == 4 * (len(prompt) - 1)
    for s in samples:
        assert torch.allclose(torch.tensor(s.logprobs), full_forward_logprobs(model, s), atol=1e-4)

    # a sibling running under the old weights does not lend its entries to a new sample
    other = load_model("builtin", torch.device("cpu"), torch.float32).eval()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.05)
    first = Sample(prompt, SamplingParams(max_new_tokens=30))
    eng.submit([first])
    for _ in range(5):
        eng.step()
    eng.update_weights(other.state_dict(), version=1)
    late = Sample(prompt, SamplingParams(max_new_tokens=8))
    before = eng.stats.prefill_tokens
    eng.submit([late])
    while eng.num_pending:
        eng.step()
    assert eng.stats.prefill_tokens == before + len(prompt) - 1  # prefilled under the new weights
    assert torch.allclose(torch.tensor(late.logprobs), full_forward_logprobs(other, late), atol=1e-4)


@pytest.mark.parametrize("cache_tokens", [-1, 0])
def test_queued_prompts_are_prefilled_with_the_first_in_one_batch_and_copied_later(builtin,
                                                                                    cache_tokens):
    """Two slots, three prompts of three samples: the first admission computes all three
    prompts in one forward pass (the queued ones with it) and every later sample copies them;
    without a prompt cache each group's first sample is prefilled when admitted. Log-probs
    equal a plain forward pass either way, and a weight update gives the cached prompts up."""
    model, tok = builtin
    eng = EmbeddedEngine(model, eos_token_ids=[], max_slots=2, max_seq_len=200, seed=6,
                         prompt_cache_tokens=cache_tokens)
    group = prompts(tok, ["[2,7,1,8]=", "[3,1,4,1,5]=", "[9,9]="])
    samples = [Sample(p, SamplingParams(temperature=1.0, max_new_tokens=n))
               for p in group for n in (6, 9, 4)]
    eng.generate(samples)
    ctx = [len(p) - 1 for p in group]
    if cache_tokens:
        assert eng.stats.prefill_calls == 1
        assert eng.stats.prefill_tokens == sum(ctx)
        assert eng.stats.prefill_shared_tokens == 3 * sum(ctx) - ctx[0]
    else:   # siblings running alongside still lend theirs; a group's first is computed alone
        assert eng.stats.prefill_calls >= 3
    for s in samples:
        assert torch.allclose(torch.tensor(s.logprobs), full_forward_logprobs(model, s), atol=1e-4)
    if cache_tokens:
        assert len(eng.prompts) == 3
        eng.update_weights(model.state_dict(), version=1)
        assert len(eng.prompts) == 0


def test_a_prompt_cache_too_small_for_one_admission_evicts_nothing_it_is_lending(builtin):
    """A bound of one prompt: an admission's new prompts evict the entry that admission had
    found cached; the samples it was lent to still get it (a KeyError before), and every
    log-prob equals a plain forward pass."""
    model, tok = builtin
    group = prompts(tok, ["[2,7,1,8]=", "[3,1,4,1,5]=", "[9,9]=", "[6,0,2]=", "[4,4,4,4,4,4]=",
                          "[1]=", "[5,3]=", "[8,8,1]="])
    eng = EmbeddedEngine(model, eos_token_ids=[], max_slots=3, max_seq_len=200, seed=3,
                         prompt_cache_tokens=max(map(len, group)))
    samples = [Sample(p, SamplingParams(temperature=1.0, max_new_tokens=n))
               for p in group for n in (2, 9)]
    eng.generate(samples)
    assert eng.stats.prefill_shared_tokens > 0   # the cache (or a sibling) lent something
    for s in samples:
        assert torch.allclose(torch.tensor(s.logprobs), full_forward_logprobs(model, s), atol=1e-4)


@pytest.mark.parametrize("config_cls, extra", [
    (LlamaConfig, {}), (Qwen2Config, {}), (Qwen3Config, {"head_dim": 16}),
])
def test_other_llama_family_architectures_match(config_cls, extra):
    model = tiny_hf_model(config_cls, 256, **extra)
    eng = EmbeddedEngine(model, eos_token_ids=[0], max_slots=4, max_seq_len=128, seed=0)
    samples = [Sample([5, 6, 7, 8][:n], SamplingParams(max_new_tokens=30)) for n in (1, 2, 3, 4, 2)]
    eng.generate(samples)
    for s in samples:
        assert torch.allclose(torch.tensor(s.logprobs), full_forward_logprobs(model, s), atol=1e-4)


def test_unsupported_architecture_is_rejected_by_name():
    from transformers import GPT2Config
    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2,
                                                        vocab_size=40))
    with pytest.raises(ValueError, match="gpt2"):
        EmbeddedEngine(model, eos_token_ids=[0])


def test_greedy_continuous_batching_equals_generating_each_alone(builtin):
    model, tok = builtin
    ps = prompts(tok, TEXTS + ["[2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2]="])
    greedy = SamplingParams(temperature=0.0, max_new_tokens=120)
    alone = []
    for p in ps:
        eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=1, max_seq_len=200)
        s = Sample(p, greedy)
        eng.generate([s])
        alone.append(s.response_ids)
    # two slots for six requests: slots are refilled as short answers finish
    eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=2, max_seq_len=200)
    batched = [Sample(p, greedy) for p in ps]
    eng.generate(batched)
    assert [s.response_ids for s in batched] == alone
    assert eng.stats.decode_steps < sum(len(r) for r in alone)  # rows really ran together


def test_abort_and_resume_keep_prefix_versions_and_lose_nothing(builtin):
    model, tok = builtin
    eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=4, max_seq_len=300,
                         seed=1)
    long = "[" + ",".join(["9"] * 20) + "]="
    samples = [Sample(p, SamplingParams(max_new_tokens=200)) for p in prompts(tok, [long] * 3)]
    queued = Sample(prompts(tok, [long])[0], SamplingParams(max_new_tokens=200))
    eng.submit(samples)
    for _ in range(10):
        eng.step()
    eng.submit([queued])  # no free slot? it may be queued or running: abort must return it
    parts = eng.abort()
    assert {s.request_id for s in parts} == {s.request_id for s in samples + [queued]}
    assert all(s.finish_reason == ABORT for s in parts) and eng.num_pending == 0
    prefixes = {s.request_id: (list(s.response_ids), list(s.logprobs)) for s in samples}
    assert all(len(p[0]) == 10 for p in prefixes.values())
    new_weights = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
    eng.update_weights(new_weights, version=1)
    eng.generate(samples)
    for s in samples:
        s.check()
        ids, lps = prefixes[s.request_id]
        assert s.response_ids[:10] == ids and s.logprobs[:10] == lps
        assert s.versions[:10] == [0] * 10 and set(s.versions[10:]) == {1}
        assert s.finish_reason in ("stop", "length")


def test_resumed_tokens_have_the_logprobs_of_the_new_weights(builtin):
    model, tok = builtin
    eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=2, max_seq_len=300,
                         seed=2)
    s = Sample(prompts(tok, ["[" + ",".join(["8"] * 15) + "]="])[0],
               SamplingParams(max_new_tokens=150))
    eng.submit([s])
    for _ in range(5):
        eng.step()
    torch.manual_seed(1)
    model2 = load_model("builtin", torch.device("cpu"), torch.float32).eval()
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(0.02 * torch.randn_like(p))
    # weight update with KV recompute in the middle of decoding
    eng.update_weights(model2.state_dict(), version=7, recompute_kv=True)
    while eng.num_pending:
        eng.step()
    ref_new = full_forward_logprobs(model2, s)
    n_old = s.versions.count(0)
    assert n_old == 5 and set(s.versions[5:]) == {7}
    assert torch.allclose(torch.tensor(s.logprobs[5:]), ref_new[5:], atol=1e-4)


def test_segment_limit_parks_a_sample_and_it_continues(builtin):
    model, tok = builtin
    eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=2, max_seq_len=300)
    s = Sample(prompts(tok, ["[" + ",".join(["7"] * 20) + "]="])[0],
               SamplingParams(temperature=0.0, max_new_tokens=200, segment_max_tokens=16))
    ref = Sample(list(s.prompt_ids), SamplingParams(temperature=0.0, max_new_tokens=200))
    EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=1,
                   max_seq_len=300).generate([ref])
    segments = 0
    while not s.done:
        eng.generate([s])
        segments += 1
        assert s.finish_reason in (SEGMENT, STOP, "length")
    assert segments == -(-len(ref.response_ids) // 16)
    assert s.response_ids == ref.response_ids


def test_sampling_is_reproducible_with_a_seed(builtin):
    model, tok = builtin

    def run(seed):
        eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=4,
                             max_seq_len=200, seed=seed)
        ss = [Sample(p, SamplingParams(max_new_tokens=60)) for p in prompts(tok, TEXTS)]
        eng.generate(ss)
        return [s.response_ids for s in ss]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_too_long_request_is_refused_with_the_limit(builtin):
    model, tok = builtin
    eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=1, max_seq_len=32)
    with pytest.raises(ValueError, match="max_seq_len 32"):
        eng.submit([Sample([5] * 10, SamplingParams(max_new_tokens=40))])


def test_parked_cache_resumes_without_prefill_and_gives_the_same_tokens(builtin):
    model, tok = builtin
    long = "[" + ",".join(["6"] * 18) + "]="
    greedy = SamplingParams(temperature=0.0, max_new_tokens=150)
    ref = [Sample(p, greedy) for p in prompts(tok, [long, "[1,2,3,4,5,6,7,8]="])]
    EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=4,
                   max_seq_len=300).generate(ref)

    eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=4, max_seq_len=300)
    samples = [Sample(list(r.prompt_ids), greedy) for r in ref]
    eng.submit(samples)
    for _ in range(12):
        eng.step()
    parked = eng.abort(keep_cache=True)
    assert len(parked) == 2 and len(eng.parked) == 2 and eng.num_pending == 0
    before = eng.stats.prefill_tokens
    eng.generate(samples)
    assert eng.stats.prefill_tokens == before  # continued from the parked caches
    assert [s.response_ids for s in samples] == [r.response_ids for r in ref]


@pytest.mark.parametrize("park_tokens", [0, -1])
def test_parked_caches_give_way_to_new_work_and_stay_correct(builtin, park_tokens):
    """The new work takes the slots: the oldest parked caches leave them, given up with no
    store (park_tokens 0), copied out to the store with one (-1: as large as the slots)."""
    model, tok = builtin
    greedy = SamplingParams(temperature=0.0, max_new_tokens=150)
    texts = ["[" + ",".join([str(d)] * 14) + "]=" for d in range(1, 10)]
    ref = [Sample(p, greedy) for p in prompts(tok, texts)]
    EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=3,
                   max_seq_len=300).generate(ref)

    eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=3, max_seq_len=300,
                         park_tokens=park_tokens)
    first = [Sample(list(r.prompt_ids), greedy) for r in ref[:3]]
    eng.submit(first)
    for _ in range(8):
        eng.step()
    eng.abort(keep_cache=True)
    others = [Sample(list(r.prompt_ids), greedy) for r in ref[3:]]
    eng.submit(others[:2])
    for _ in range(5):
        eng.step()
    assert len(eng.parked) == (1 if park_tokens == 0 else 3)
    assert len(eng.stored) == (0 if park_tokens == 0 else 2)
    before = eng.stats.resumed_prefill_tokens
    eng.submit(first)      # continued from their parked caches, or prefilled again
    eng.generate(others[2:])
    while eng.num_pending:
        eng.step()
    assert [s.response_ids for s in first + others] == [r.response_ids for r in ref]
    history = 2 * (len(first[0].prompt_ids) + 8 - 1)   # the two given up, prefilled again
    assert eng.stats.resumed_prefill_tokens - before == (history if park_tokens == 0 else 0)
