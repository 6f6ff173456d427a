"""The embedded engine's kept KV caches (trainer/engine/parking.py): a parked sample resumes over
its cache, across a weight update too, and an episode's next turn prefills only the environment's
tokens. References are computed by hand with the Hugging Face model and its own cache."""
import copy

import pytest
import torch
from helpers import full_forward_logprobs, tiny_hf_model
from transformers import DynamicCache, Qwen2Config

from trainer.engine.base import ENV_VERSION, STOP, Sample, SamplingParams
from trainer.engine.embedded import EmbeddedEngine

PROMPTS = [[3, 17, 5, 8], [11, 2, 40, 7, 7, 9, 21], [4, 4], [30, 1, 2, 3, 4, 5]]


@pytest.fixture(scope="module")
def model():
    return tiny_hf_model(Qwen2Config)


def engine(model, max_slots=8):
    # no eos: every response runs to its budget, so lengths are known
    return EmbeddedEngine(model, eos_token_ids=[], max_slots=max_slots, max_seq_len=128,
                          attn_bucket_overhead=0)


def samples(n_new=12, prompts=PROMPTS):
    return [Sample(list(p), SamplingParams(temperature=0, max_new_tokens=n_new)) for p in prompts]


def run_until(eng, todo, tokens):
    """Step until every sample has `tokens` response tokens (one per decode step)."""
    eng.submit(todo)
    while min(len(s.response_ids) for s in todo) < tokens:
        eng.step()


def finish(eng, todo):
    eng.submit(todo)
    while eng.num_pending:
        eng.step()


def new_weights(model):
    torch.manual_seed(7)
    return {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}


def test_greedy_outputs_are_the_same_with_and_without_a_kept_cache(model):
    straight = samples()
    engine(model).generate(straight)
    for keep in (True, False):
        eng = engine(model)
        todo = samples()
        run_until(eng, todo, 5)
        eng.abort(keep_cache=keep)
        before = copy.copy(eng.stats)
        finish(eng, todo)
        assert [s.response_ids for s in todo] == [s.response_ids for s in straight]
        history = sum(len(s.prompt_ids) + 5 - 1 for s in todo)
        resumed = eng.stats.resumed_prefill_tokens - before.resumed_prefill_tokens
        kept = eng.stats.kv_kept_tokens - before.kv_kept_tokens
        # kept: the resumed samples prefill nothing, and go on from every cached position
        assert (resumed, kept) == ((0, history) if keep else (history, 0))
        assert eng.stats.prefill_tokens - before.prefill_tokens == (0 if keep else history)


def hand_reference(model, weights, prompt, head, n_new):
    """Greedy continuation of prompt + head: the cache of prompt + head[:-1] computed by `model`
    (the old weights), every later token by `weights` (the new ones). Returns (tokens, logprobs)."""
    new = copy.deepcopy(model)
    new.load_state_dict(weights)
    cache = DynamicCache()
    ctx = prompt + head
    with torch.no_grad():
        model(torch.tensor([ctx[:-1]]), past_key_values=cache, use_cache=True)
        last, tokens, logps = ctx[-1], [], []
        for _ in range(n_new):
            logits = new(torch.tensor([[last]]), past_key_values=cache, use_cache=True).logits[0, -1]
            logp = torch.log_softmax(logits.float(), -1)
            last = int(logits.argmax())
            tokens.append(last)
            logps.append(float(logp[last]))
    return tokens, logps


def test_a_kept_cache_continues_under_new_weights_as_computed_by_hand(model):
    weights, k, n = new_weights(model), 5, 12
    eng = engine(model)
    todo = samples(n)
    run_until(eng, todo, k)
    eng.abort(keep_cache=True)
    heads = [list(s.response_ids) for s in todo]
    eng.update_weights(weights, version=1)
    before = eng.stats.prefill_tokens
    finish(eng, todo)
    assert eng.stats.prefill_tokens == before       # nothing prefilled again
    for s, head in zip(todo, heads):
        tokens, logps = hand_reference(model, weights, s.prompt_ids, head, n - k)
        assert s.response_ids == head + tokens
        assert torch.allclose(torch.tensor(s.logprobs[k:]), torch.tensor(logps), atol=1e-4)
        assert s.versions == [0] * k + [1] * (n - k)
    # and it is not what a re-prefill under the new weights gives: the test can tell them apart
    redo = engine(model)
    redo.update_weights(weights, version=1)
    again = [Sample(s.prompt_ids, s.params, response_ids=h, logprobs=[0.0] * k, versions=[0] * k)
             for s, h in zip(todo, heads)]
    finish(redo, again)
    assert any(not torch.allclose(torch.tensor(a.logprobs[k:]), torch.tensor(s.logprobs[k:]),
                                  atol=1e-4) for a, s in zip(again, todo))


def test_recompute_drops_the_parked_caches_and_is_exact_under_the_new_weights(model):
    weights, k, n = new_weights(model), 5, 12
    new = copy.deepcopy(model)
    new.load_state_dict(weights)
    eng = engine(model)
    todo = samples(n)
    run_until(eng, todo, k)
    eng.abort(keep_cache=True)
    eng.update_weights(weights, version=1, recompute_kv=True)
    assert not eng.parked and eng.stats.parked_kv_tokens == 0
    finish(eng, todo)
    assert eng.stats.resumed_prefill_tokens == sum(len(s.prompt_ids) + k - 1 for s in todo)
    for s in todo:
        ref = full_forward_logprobs(new, s)
        assert torch.allclose(torch.tensor(s.logprobs[k:]), ref[k:], atol=1e-4)


def parked_three(model, park_tokens):
    """Two engine slots; a and b parked after 4 tokens, then c run to its end: b's cache (the
    oldest) leaves the slots for the store (or is given up), a's moves."""
    a, b, c = samples(10, PROMPTS[:3])
    eng = EmbeddedEngine(model, eos_token_ids=[], max_slots=2, max_seq_len=128,
                         attn_bucket_overhead=0, park_tokens=park_tokens)
    run_until(eng, [a, b], 4)
    eng.abort(keep_cache=True)             # parks b (slot 1) first, then a (slot 0): b is oldest
    assert list(eng.parked) == [b.request_id, a.request_id]
    assert eng.stats.parked_kv_tokens == len(a.prompt_ids) + len(b.prompt_ids) + 2 * 3
    finish(eng, [c])                       # c needs a slot: every slot holds a parked cache
    return eng, a, b, c


def test_with_no_store_the_oldest_parked_cache_is_given_up_and_prefilled_again(model):
    straight = samples(10, PROMPTS[:3])
    engine(model).generate(straight)
    eng, a, b, c = parked_three(model, park_tokens=0)
    assert eng.stats.kv_evicted == 1 and list(eng.parked) == [a.request_id]
    before = copy.copy(eng.stats)
    finish(eng, [a, b])
    assert eng.stats.kv_kept_tokens - before.kv_kept_tokens == len(a.prompt_ids) + 3
    assert (eng.stats.resumed_prefill_tokens - before.resumed_prefill_tokens
            == len(b.prompt_ids) + 3)
    assert [s.response_ids for s in (a, b, c)] == [s.response_ids for s in straight]


def test_the_store_keeps_a_cache_out_of_the_slots_within_its_bound(model):
    straight = samples(10, PROMPTS[:3])
    engine(model).generate(straight)
    eng, a, b, c = parked_three(model, park_tokens=len(PROMPTS[1]) + 3)   # b's cache just fits
    assert eng.stats.kv_evicted == 0 and eng.stats.kv_store_tokens == len(b.prompt_ids) + 3
    before = copy.copy(eng.stats)
    finish(eng, [a, b])
    assert eng.stats.prefill_tokens == before.prefill_tokens          # both went on from a cache
    assert eng.stats.kv_kept_tokens - before.kv_kept_tokens == before.parked_kv_tokens
    assert [s.response_ids for s in (a, b, c)] == [s.response_ids for s in straight]
    # one position less and the store cannot hold it: given up, prefilled again
    eng, a, b, c = parked_three(model, park_tokens=len(PROMPTS[1]) + 2)
    assert eng.stats.kv_evicted == 1 and eng.stats.kv_store_tokens == 0


def test_an_episode_turn_keeps_its_cache_and_the_next_prefills_only_the_environment(model):
    eng = EmbeddedEngine(model, eos_token_ids=[], max_slots=4, max_seq_len=128,
                         attn_bucket_overhead=0)
    s = Sample([3, 17, 5, 8, 2], SamplingParams(temperature=0, max_new_tokens=40))
    s.meta["episode"] = {"turns": 1, "end": ""}
    eng.submit([s])
    for _ in range(6):
        eng.step()
    # the turn ends (an end-of-turn token, or a stop string: the wrapper aborts it keeping the cache)
    out = eng.abort([s.request_id], keep_cache=True)
    assert out == [s] and s.request_id in eng.parked
    env = [9, 9, 12, 30, 1]                # the environment's message
    s.response_ids += env
    s.logprobs += [0.0] * len(env)
    s.versions += [ENV_VERSION] * len(env)
    before = copy.copy(eng.stats)
    eng.submit([s])
    eng.step()                              # turn 2's admission and its first token
    assert eng.stats.prefill_tokens - before.prefill_tokens == len(env)
    assert eng.stats.resumed_prefill_tokens == before.resumed_prefill_tokens
    assert eng.stats.kv_kept_tokens - before.kv_kept_tokens == len(s.prompt_ids) + 6 - 1
    for _ in range(4):
        eng.step()
    eng.abort()
    policy = [i for i, v in enumerate(s.versions) if v != ENV_VERSION]
    ref = full_forward_logprobs(model, s)[policy]   # what a prefill from the first token gives
    assert torch.allclose(torch.tensor(s.logprobs)[policy], ref, atol=1e-4)


def test_an_episode_stopped_by_its_end_of_turn_token_is_parked_and_dropped_when_over(model):
    first = engine(model)
    probe = samples(3, PROMPTS[:1])[0]
    first.generate([probe])
    eos = probe.response_ids[2]            # greedy: the third token ends the turn
    eng = EmbeddedEngine(model, eos_token_ids=[eos], max_slots=4, max_seq_len=128)
    turn, single = samples(40, PROMPTS[:1] * 2)
    turn.meta["episode"] = {"turns": 1, "end": ""}
    eng.generate([turn, single])
    assert turn.finish_reason == single.finish_reason == STOP
    assert list(eng.parked) == [turn.request_id]   # the single-turn answer is done: no cache
    eng.drop_cache([turn.request_id])
    assert not eng.parked and eng.stats.parked_kv_tokens == 0
