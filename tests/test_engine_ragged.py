"""Ragged decode attention (rows bucketed by length), fused weights and parked segment stops:
the embedded engine still equals a plain forward pass of the model."""
import pytest
import torch
from helpers import full_forward_logprobs, tiny_hf_model
from transformers import LlamaConfig, Qwen3Config

from trainer.engine.base import SEGMENT, STOP, Sample, SamplingParams
from trainer.engine.buckets import BUCKET_OVERHEAD, plan_buckets
from trainer.engine.decoder import Decoder
from trainer.engine.embedded import EmbeddedEngine
from trainer.engine.process import ProcessEngine
from trainer.models.loading import load_model, load_tokenizer

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def builtin():
    return load_model("builtin", CPU, torch.float32).eval(), load_tokenizer("builtin")


def _perturbed(seed=1, scale=0.02):
    """The built-in model with noise on every parameter (tied embeddings stay tied)."""
    torch.manual_seed(seed)
    model = load_model("builtin", CPU, torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


def _mixed(tok):
    """Some short prompts, one long one (~250 tokens): a decode step holds very ragged rows."""
    long = "[" + ",".join(["7"] * 120) + "]="
    texts = ["[3,5]=", "[9]=", long, "[1,2]=", "[4,4,4,4]=", "[8,1]="]
    return [tok(t).input_ids for t in texts]


def test_plan_buckets_splits_a_long_row_off_and_keeps_uniform_batches_whole():
    plan = plan_buckets([30] * 127 + [300], overhead=1024)
    assert [(r if r is None else len(r), T) for r, T, _ in plan] == [(None, 31), (1, 301)]
    for device in ("cpu", "cuda"):  # the defaults: one long row among short ones is split off
        assert len(plan_buckets([30] * 255 + [1500], overhead=BUCKET_OVERHEAD[device])) == 2
    assert len(plan_buckets([30] * 127 + [300], overhead=BUCKET_OVERHEAD["cpu"])) == 2
    assert plan_buckets([30] * 128, overhead=1024) == [(None, 31, 30)]
    assert len(plan_buckets([28, 31, 30, 29] * 32, overhead=1024)) == 1  # padding too small
    # every row lands in exactly one bucket, which covers its length
    lens = [5, 300, 17, 64, 65, 200, 9, 130, 131, 40] * 3
    plan = plan_buckets(lens, overhead=0)
    assert len(plan) > 2
    listed = [r for rows, _, _ in plan if rows is not None for r in rows]
    assert len(listed) == len(set(listed))  # no row in two buckets
    base = plan[0] if plan[0][0] is None else None
    for rows, T, lo in plan:
        if rows is not None:
            assert all(lens[r] < T for r in rows) and min(lens[r] for r in rows) == lo
    rest = set(range(len(lens))) - set(listed)
    assert not rest or (base is not None and all(lens[r] < base[1] for r in rest))


def _plan_cost(lengths, plan, overhead, gather):
    """The cost model of buckets.plan_buckets, from the plan itself."""
    cost = len(lengths) * plan[0][1]   # the base bucket: a slice over every row
    for rows, T, _ in plan[1:]:
        consecutive = rows[-1] - rows[0] + 1 == len(rows)
        cost += (1.0 if consecutive else gather) * len(rows) * T + overhead
    return cost


def test_plan_buckets_is_the_cheapest_plan_under_its_cost_model():
    import itertools
    import random

    from trainer.engine.buckets import GATHER_FACTOR, _classes

    rng = random.Random(5)
    for trial in range(60):
        B = rng.choice([4, 16, 64, 128])
        lens = [min(900, int(10 + rng.paretovariate(rng.choice([0.8, 1.5, 3.0])) * 20))
                for _ in range(B)]
        if trial % 5 == 0:  # long rows in consecutive slots
            lens.sort()
        plan = plan_buckets(lens, overhead=4096)
        cls = _classes(max(lens))
        groups = sorted({cls[n] for n in lens})
        by = {k: [r for r, n in enumerate(lens) if cls[n] == k] for k in groups}
        best = len(lens) * (max(lens) + 1)        # the padded batch
        m = len(groups)
        for j in range(1, m):                     # every base cut and contiguous grouping above it
            for cuts in itertools.product([0, 1], repeat=m - j - 1):
                if sum(cuts) + 2 > 6:
                    continue
                parts, cur = [], [groups[j]]
                for c, k in zip(cuts, groups[j + 1:]):
                    if c:
                        parts.append(cur)
                        cur = []
                    cur.append(k)
                parts.append(cur)
                base_T = max(lens[r] for k in groups[:j] for r in by[k]) + 1
                cand = [(None, base_T, 0)] + [
                    (sorted(r for k in part for r in by[k]),
                     max(lens[r] for k in part for r in by[k]) + 1, 0) for part in parts]
                best = min(best, _plan_cost(lens, cand, 4096, GATHER_FACTOR))
        assert _plan_cost(lens, plan, 4096, GATHER_FACTOR) == pytest.approx(best), (lens, plan)
        covered = sorted(r for rows, _, _ in plan[1:] for r in rows)
        assert len(covered) == len(set(covered))
        assert all(lens[r] < plan[0][1] for r in set(range(B)) - set(covered))


def test_evenly_spread_lengths_stay_one_padded_bucket_and_two_slot_ranges_split():
    # gathering 54 of 128 rows costs more than padding them (measured: 2x slower, it was the plan)
    assert plan_buckets([30 + (i * 37) % 170 for i in range(128)],
                        overhead=BUCKET_OVERHEAD["cpu"]) == [(None, 199, 30)]
    # the same lengths in two consecutive slot ranges: sliced, no gather, so split
    plan = plan_buckets([40] * 64 + [300] * 64, overhead=BUCKET_OVERHEAD["cpu"])
    assert [(r if r is None else (r[0], len(r)), T) for r, T, _ in plan] == [(None, 41), ((64, 64), 301)]


@pytest.mark.parametrize("arch", ["builtin", "llama-bias", "qwen3"])
@pytest.mark.parametrize("overhead", [0, 1024, float("inf")])
def test_one_decode_step_over_ragged_rows_equals_the_model(builtin, arch, overhead):
    if arch == "builtin":
        model, vocab = builtin[0], 90
    elif arch == "llama-bias":
        model, vocab = tiny_hf_model(LlamaConfig, attention_bias=True, mlp_bias=True), 50
    else:
        model, vocab = tiny_hf_model(Qwen3Config, head_dim=16), 50
    dec = Decoder(model, CPU, torch.float32, bucket_overhead=overhead)
    g = torch.Generator().manual_seed(0)
    # long rows in non-consecutive slots (a gathered bucket), short ones around them
    lens = [3, 300, 12, 280, 30, 31, 7, 150, 29, 1]
    seqs = [torch.randint(3, vocab, (n + 1,), generator=g).tolist() for n in lens]
    cache = dec.new_cache(len(lens), 400)
    dec.prefill(cache, list(range(len(lens))), [s[:-1] for s in seqs])
    logits = dec.decode(cache, torch.tensor([s[-1] for s in seqs]), lens)
    if overhead == 0:
        assert len(dec.plan(lens, torch.tensor(lens))) >= 3
    for b, s in enumerate(seqs):
        with torch.no_grad():
            ref = model(torch.tensor([s])).logits[0, -1].float()
        assert torch.allclose(logits[b], ref, atol=1e-4), (arch, overhead, b)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_with_mixed_lengths_match_a_plain_forward_pass(builtin, temperature):
    model, tok = builtin
    for overhead in (0, None):
        eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=6,
                             max_seq_len=400, seed=3, attn_bucket_overhead=overhead)
        samples = [Sample(p, SamplingParams(temperature=temperature, max_new_tokens=100))
                   for p in _mixed(tok)]
        eng.generate(samples)
        for s in samples:
            s.check()
            ref = full_forward_logprobs(model, s, temperature)
            assert torch.allclose(torch.tensor(s.logprobs), ref, atol=1e-4)


def _hf_greedy(model, prompt, eos, max_new):
    """A plain greedy loop over the model's forward pass (no cache)."""
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(nxt)
            ids.append(nxt)
            if nxt == eos:
                break
    return out


def test_greedy_outputs_equal_a_plain_greedy_loop(builtin):
    model, tok = builtin
    ps = _mixed(tok)
    ref = [_hf_greedy(model, p, tok.eos_token_id, 60) for p in ps]
    eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=4, max_seq_len=400,
                         attn_bucket_overhead=0)
    got = [Sample(p, SamplingParams(temperature=0.0, max_new_tokens=60)) for p in ps]
    eng.generate(got)
    assert [s.response_ids for s in got] == ref


def test_segment_stops_park_the_cache_and_resume_without_prefill(builtin):
    model, tok = builtin
    eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=6, max_seq_len=400,
                         seed=5, attn_bucket_overhead=0)
    samples = [Sample(p, SamplingParams(temperature=1.0, max_new_tokens=120,
                                        segment_max_tokens=8)) for p in _mixed(tok)]
    first = eng.generate(samples)
    prefilled = eng.stats.prefill_tokens
    assert any(s.finish_reason == SEGMENT for s in first)
    assert sum(len(s.prompt_ids) - 1 for s in samples) == prefilled
    rounds = 1
    while not all(s.done for s in samples):
        todo = [s for s in samples if not s.done]
        assert all(s.request_id in eng.parked for s in todo)  # parked, not thrown away
        eng.generate(todo)
        rounds += 1
    assert rounds > 2 and eng.stats.prefill_tokens == prefilled  # never prefilled again
    for s in samples:
        s.check()
        assert torch.allclose(torch.tensor(s.logprobs), full_forward_logprobs(model, s), atol=1e-4)


def test_parked_caches_resume_with_equal_logprobs(builtin):
    """abort(keep_cache=True) and segment stops, one after the other, on the same samples."""
    model, tok = builtin
    eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=4, max_seq_len=400,
                         seed=7, attn_bucket_overhead=0)
    samples = [Sample(p, SamplingParams(temperature=1.0, max_new_tokens=80))
               for p in _mixed(tok)[:4]]
    eng.submit(samples)
    for _ in range(6):
        eng.step()
    parked = eng.abort(keep_cache=True)
    assert len(parked) >= 2 and all(s.request_id in eng.parked for s in parked)
    before = eng.stats.prefill_tokens
    for s in parked:
        s.params = SamplingParams(temperature=1.0, max_new_tokens=80, segment_max_tokens=5)
    eng.generate(parked)
    eng.generate([s for s in parked if not s.done])
    assert eng.stats.prefill_tokens == before
    for s in samples:
        assert torch.allclose(torch.tensor(s.logprobs), full_forward_logprobs(model, s), atol=1e-4)


def test_weights_changed_while_parked_at_a_segment_stop(builtin):
    """recompute_kv drops parked caches: the resumed sample is prefilled under the new weights
    and its new tokens have the new model's log-probabilities; without it the cache stays."""
    model, tok = builtin
    model2 = _perturbed()
    for recompute in (True, False):
        eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=4,
                             max_seq_len=400, seed=2)
        s = Sample(_mixed(tok)[2], SamplingParams(temperature=1.0, max_new_tokens=60,
                                                  segment_max_tokens=10))
        eng.generate([s])
        assert s.finish_reason == SEGMENT and s.request_id in eng.parked
        prefilled = eng.stats.prefill_tokens
        eng.update_weights(model2.state_dict(), version=1, recompute_kv=recompute)
        eng.generate([s])
        assert s.versions == [0] * 10 + [1] * (len(s.response_ids) - 10)
        if recompute:
            assert eng.stats.prefill_tokens == prefilled + len(s.prompt_ids) + 9
            ref = full_forward_logprobs(model2, s)
            assert torch.allclose(torch.tensor(s.logprobs[10:]), ref[10:], atol=1e-4)
        else:
            assert eng.stats.prefill_tokens == prefilled


def test_fused_weights_follow_update_weights(builtin):
    model, tok = builtin
    model2 = _perturbed(seed=4, scale=0.05)
    new = model2.state_dict()
    eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=4, max_seq_len=400)
    eng.update_weights(new, version=2)
    L = eng.decoder.layers[1]
    p = "model.layers.1."
    assert torch.equal(L["qkv"], torch.cat([new[p + f"self_attn.{n}_proj.weight"]
                                            for n in "qkv"]))
    assert torch.equal(L["qkv_b"], torch.cat([new[p + f"self_attn.{n}_proj.bias"]
                                              for n in "qkv"]))
    assert torch.equal(L["gu"], torch.cat([new[p + "mlp.gate_proj.weight"],
                                           new[p + "mlp.up_proj.weight"]]))
    samples = [Sample(q, SamplingParams(max_new_tokens=40)) for q in _mixed(tok)]
    eng.generate(samples)
    for s in samples:
        assert set(s.versions) == {2}
        assert torch.allclose(torch.tensor(s.logprobs), full_forward_logprobs(model2, s), atol=1e-4)


def test_fused_weights_follow_update_weights_in_the_process_engine(builtin):
    model, tok = builtin
    model2 = _perturbed(seed=6, scale=0.05)
    eng = ProcessEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=4, max_seq_len=400,
                        seed=1)
    try:
        eng.update_weights(model2.state_dict(), version=5)
        samples = [Sample(q, SamplingParams(max_new_tokens=40, segment_max_tokens=15))
                   for q in _mixed(tok)]
        while not all(s.done for s in samples):
            eng.generate([s for s in samples if not s.done])
        for s in samples:
            assert set(s.versions) == {5} and s.finish_reason in (STOP, "length")
            ref = full_forward_logprobs(model2, s)
            assert torch.allclose(torch.tensor(s.logprobs), ref, atol=1e-4)
    finally:
        eng.close()
