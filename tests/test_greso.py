"""GRESO selective-rollout logic against hand-computed cases."""
import io
import json

import pytest
import torch

from trainer.config import GresoConfig
from trainer.rollout.greso import Decision, GresoFilter, classify

CFG = GresoConfig()          # alpha 0.25, delta_p 0.01, min_p 0.05, max_p 0.95, p_floor 0.01

CORRECT = [1.0, 1.0, 1.0, 1.0]
WRONG = [0.0, 0.0, 0.0, 0.0]
MIXED = [1.0, 0.0, 1.0, 0.0]


def filter_with(*groups, pid="q", **kw):
    f = GresoFilter(**kw)
    for step, rewards in enumerate(groups):
        f.record(pid, step, rewards)
    return f


# -- classification and traces ------------------------------------------------------------------

def test_classify_outcomes():
    assert classify(CORRECT) == "all_correct"
    assert classify([1.0 - 1e-12] * 3) == "all_correct"          # within tolerance of 1
    assert classify([1.5, 1.5]) == "all_correct"                 # >= 1 counts as correct
    assert classify(WRONG) == "all_wrong"
    assert classify([-0.1, -0.1, -0.1]) == "all_wrong"          # all overlong-penalised
    assert classify([0.5, 0.5]) == "all_wrong"                   # constant below full marks
    assert classify([1.0, 0.9]) == "mixed"
    assert classify([0.0, -0.1]) == "mixed"
    assert classify([1.0]) == "all_correct"                      # a group of one
    with pytest.raises(ValueError):
        classify([])


def test_record_returns_kind_and_traces_step_and_mean():
    f = GresoFilter()
    assert f.record("q", 3, MIXED) == "mixed"
    assert f.record("q", 5, [1.0, 1.0]) == "all_correct"
    assert f.record("q", 9, [-0.25, -0.25]) == "all_wrong"
    assert f.trace("q") == [(3, 0.5), (5, 1.0), (9, -0.25)]
    assert f.trace("never-seen") == []


def test_trace_is_bounded_to_most_recent():
    f = GresoFilter(max_trace=5)
    for step in range(100):
        f.record("q", step, CORRECT)
    assert [s for s, _ in f.trace("q")] == [95, 96, 97, 98, 99]
    assert f.decide("q", CFG).streak == 5                         # streak cannot exceed the trace


# -- streaks and keep probability ---------------------------------------------------------------

def test_easy_streak_of_three_after_a_mixed_group():
    d = filter_with(MIXED, CORRECT, CORRECT, CORRECT).decide("q", CFG)
    assert (d.kind, d.streak) == ("easy", 3)
    assert d.keep_prob == pytest.approx(0.125)                    # 0.5 ** 3


def test_mixed_group_resets_the_streak():
    f = filter_with(CORRECT, CORRECT, CORRECT, MIXED)
    rng_before = f.state_dict()["rng"]
    for _ in range(50):
        assert f.decide("q", CFG) == Decision(skip=False, kind=None, streak=0, keep_prob=1.0)
    assert f.state_dict()["rng"] == rng_before                    # no draw for unskippable prompts


def test_no_history_is_always_kept():
    f = GresoFilter()
    assert f.decide("new", CFG) == Decision(skip=False, kind=None, streak=0, keep_prob=1.0)


def test_hard_streak():
    d = filter_with(CORRECT, WRONG, WRONG).decide("q", CFG)       # a change of kind restarts z
    assert (d.kind, d.streak) == ("hard", 2)
    assert d.keep_prob == pytest.approx(0.25)                     # 0.5 ** 2
    d = filter_with(WRONG, WRONG, CORRECT).decide("q", CFG)
    assert (d.kind, d.streak) == ("easy", 1)
    assert d.keep_prob == pytest.approx(0.5)


def test_overlong_penalised_groups_count_as_all_wrong():
    d = filter_with([-0.1] * 4, [-0.1] * 4).decide("q", CFG)
    assert (d.kind, d.streak) == ("hard", 2)


def test_easy_and_hard_use_their_own_p():
    f = GresoFilter(p_easy=0.8, p_hard=0.3)
    for step in range(2):
        f.record("e", step, CORRECT)
        f.record("h", step, WRONG)
    assert f.decide("e", CFG).keep_prob == pytest.approx(0.64)    # 0.8 ** 2
    assert f.decide("h", CFG).keep_prob == pytest.approx(0.09)    # 0.3 ** 2


def test_keep_probability_floor():
    d = filter_with(*[CORRECT] * 10).decide("q", CFG)             # 0.5 ** 10 = 0.000977 < 0.01
    assert (d.streak, d.keep_prob) == (10, 0.01)
    d = filter_with(*[WRONG] * 10).decide("q", CFG)
    assert (d.kind, d.keep_prob) == ("hard", 0.01)


def test_floor_of_one_never_skips():
    cfg = GresoConfig(p_floor=1.0)
    f = filter_with(*[CORRECT] * 4)
    assert not any(f.decide("q", cfg).skip for _ in range(200))


@pytest.mark.parametrize("n_correct, expected_skip", [(1, 0.5), (3, 0.875), (10, 0.99)])
def test_empirical_skip_frequency(n_correct, expected_skip):
    f = filter_with(*[CORRECT] * n_correct, seed=1234)
    n = 20_000
    skipped = sum(f.decide("q", CFG).skip for _ in range(n))
    # binomial std <= 0.0036 at n = 20000; 0.015 is > 4 sigma
    assert skipped / n == pytest.approx(expected_skip, abs=0.015)


def test_same_seed_same_decisions():
    a = filter_with(CORRECT, CORRECT, seed=7)
    b = filter_with(CORRECT, CORRECT, seed=7)
    first = [a.decide("q", CFG).skip for _ in range(100)]
    assert first == [b.decide("q", CFG).skip for _ in range(100)]
    assert 0 < sum(first) < 100


# -- adaptation ---------------------------------------------------------------------------------

def test_adapt_by_hand():
    f = GresoFilter()
    # all-correct 2/12 = 0.1667 >= 0.25/3 = 0.0833 -> p_easy down
    # all-wrong   1/12 = 0.0833 <  2*0.25/3 = 0.1667 -> p_hard up
    f.adapt(12, 2, 1, CFG)
    assert f.p_easy == pytest.approx(0.49)
    assert f.p_hard == pytest.approx(0.51)


def test_adapt_thresholds_are_inclusive():
    f = GresoFilter()
    f.adapt(12, 1, 2, CFG)             # 1/12 == alpha/3, 2/12 == 2*alpha/3: both ">=" -> both down
    assert (f.p_easy, f.p_hard) == (pytest.approx(0.49), pytest.approx(0.49))
    f = GresoFilter()
    f.adapt(13, 1, 2, CFG)             # 1/13 < 1/12 and 2/13 < 2/12 -> both up
    assert (f.p_easy, f.p_hard) == (pytest.approx(0.51), pytest.approx(0.51))


def test_adapt_clamps_to_min_and_max():
    f = GresoFilter(p_easy=0.055, p_hard=0.945)
    f.adapt(10, 10, 0, CFG)            # all-correct share 1.0 -> down; all-wrong 0 -> up
    assert f.p_easy == pytest.approx(0.05)
    assert f.p_hard == pytest.approx(0.95)
    for _ in range(20):
        f.adapt(10, 10, 0, CFG)
    assert (f.p_easy, f.p_hard) == (0.05, 0.95)


def test_adapt_no_groups_leaves_p_unchanged():
    f = GresoFilter(p_easy=0.3, p_hard=0.7)
    f.adapt(0, 0, 0, CFG)
    assert (f.p_easy, f.p_hard) == (0.3, 0.7)


def test_adapt_rejects_inconsistent_counts():
    f = GresoFilter()
    with pytest.raises(ValueError):
        f.adapt(4, 3, 2, CFG)
    with pytest.raises(ValueError):
        f.adapt(4, -1, 0, CFG)


def test_all_zero_variance_batch():
    f = GresoFilter()
    kinds = [f.record(f"p{i}", 0, CORRECT if i % 2 else WRONG) for i in range(12)]
    assert kinds.count("all_correct") == 6 and kinds.count("all_wrong") == 6
    decisions = [f.decide(f"p{i}", CFG) for i in range(12)]
    assert all(d.kind in ("easy", "hard") and d.streak == 1 for d in decisions)
    f.adapt(12, 6, 6, CFG)             # 0.5 >= 0.0833 and 0.5 >= 0.1667: both down
    assert (f.p_easy, f.p_hard) == (pytest.approx(0.49), pytest.approx(0.49))
    f.adapt(12, 12, 0, CFG)            # everything easy: p_easy down, p_hard up
    assert (f.p_easy, f.p_hard) == (pytest.approx(0.48), pytest.approx(0.50))
    f.adapt(12, 0, 12, CFG)            # everything hard: p_easy up, p_hard down
    assert (f.p_easy, f.p_hard) == (pytest.approx(0.49), pytest.approx(0.49))


def test_adapted_p_feeds_the_keep_probability():
    f = filter_with(CORRECT, CORRECT)
    f.adapt(12, 2, 1, CFG)             # p_easy 0.49
    assert f.decide("q", CFG).keep_prob == pytest.approx(0.49 ** 2)


# -- checkpointing ------------------------------------------------------------------------------

def _busy_filter():
    f = GresoFilter(seed=3, max_trace=4)
    for step in range(6):
        for i in range(8):
            f.record(f"p{i}", step, CORRECT if i < 3 else WRONG if i < 6 else MIXED)
        f.adapt(8, 3, 3, CFG)
    for i in range(8):
        f.decide(f"p{i}", CFG)         # advance the RNG
    return f


def _continue(f):
    out = []
    for step in range(6, 10):
        out.append([f.decide(f"p{i}", CFG) for i in range(8)])
        for i in range(8):
            f.record(f"p{i}", step, MIXED if (i + step) % 5 == 0 else CORRECT)
        f.adapt(8, 6, 0, CFG)
        out.append((f.p_easy, f.p_hard))
    return out


def test_state_dict_round_trip_json():
    original = _busy_filter()
    state = json.loads(json.dumps(original.state_dict()))
    restored = GresoFilter(seed=99, max_trace=32)           # different seed: the state must win
    restored.load_state_dict(state)
    assert restored.trace("p0") == original.trace("p0")
    assert (restored.p_easy, restored.p_hard) == (original.p_easy, original.p_hard)
    assert _continue(restored) == _continue(original)
    assert restored.trace("p7") == original.trace("p7")
    assert len(restored.trace("p7")) == 4                   # max_trace travels with the state


def test_state_dict_round_trip_torch_save():
    original = _busy_filter()
    buf = io.BytesIO()
    torch.save(original.state_dict(), buf)
    buf.seek(0)
    restored = GresoFilter()
    restored.load_state_dict(torch.load(buf, weights_only=True))
    assert _continue(restored) == _continue(original)


def test_adapt_counts_only_prompts_with_history():
    # step 1: four first-time prompts, all zero-variance: nothing is known about them, p stays
    f = GresoFilter(p_easy=0.5, p_hard=0.5, seed=0)
    first = [("a", [1.0, 1.0]), ("b", [0.0, 0.0]), ("c", [1.0, 1.0]), ("d", [0.0, 1.0])]
    assert f.adapt_from_groups(first, CFG) == 0
    assert (f.p_easy, f.p_hard) == (0.5, 0.5)
    for pid, rewards in first:
        f.record(pid, 1, rewards)
    # step 2: a and d recur (a all-correct, d mixed), e is new (all-wrong, not counted):
    # easy share 1/2 >= alpha/3 -> p_easy 0.5 - 0.01; hard share 0/2 < 2*alpha/3 -> p_hard + 0.01
    second = [("a", [1.0, 1.0]), ("d", [1.0, 0.0]), ("e", [0.0, 0.0])]
    assert f.adapt_from_groups(second, CFG) == 2
    assert f.p_easy == pytest.approx(0.49) and f.p_hard == pytest.approx(0.51)


def test_skips_are_judged_when_their_prompt_is_rolled_out_again():
    f = GresoFilter(p_easy=0.0, p_hard=0.0, seed=0)   # keep probability = p_floor: nearly always skip
    floor = GresoConfig(p_floor=0.0)
    f.record("a", 1, [1.0, 1.0])                      # easy
    f.record("b", 1, [0.0, 0.0])                      # hard
    for _ in range(3):
        assert f.decide("a", floor).skip and f.decide("b", floor).skip
    assert f.decide("c", floor).skip is False          # no history: kept, never judged
    assert f.take_skip_judgements() == (0, 0)          # nothing rolled out again yet
    f.record("a", 5, [1.0, 0.0])                       # a's next group had signal: 3 wrong skips
    f.record("b", 5, [0.0, 0.0])                       # b's had none: 3 right ones
    f.record("c", 5, [1.0, 0.0])
    assert f.take_skip_judgements() == (3, 3)
    assert f.take_skip_judgements() == (0, 0)          # taken once
    f.decide("a", floor)                               # a was mixed last: kept, not skipped
    f.record("a", 6, [1.0, 1.0])
    assert f.take_skip_judgements() == (0, 0)


def test_pending_skips_survive_a_checkpoint():
    f = GresoFilter(p_easy=0.0, seed=0)
    f.record("a", 1, [1.0, 1.0])
    assert f.decide("a", GresoConfig(p_floor=0.0)).skip
    g = GresoFilter()
    g.load_state_dict(json.loads(json.dumps(f.state_dict())))
    g.record("a", 2, [0.0, 1.0])
    assert g.take_skip_judgements() == (1, 0)
