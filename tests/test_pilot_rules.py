"""The pilot's rules (trainer/pilot/) on hand-made metric series: each advises on the series
built to trigger it, with the evidence figures computed here by hand, and stays silent on a
healthy series and on one just under its threshold. Then `python -m trainer advise` on a real
tiny run directory."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from helpers import TINY_RUN

from trainer import config as config_mod
from trainer.cli import main as cli
from trainer.pilot import april, greso, health, mismatch, staleness
from trainer.pilot.advice import propose
from trainer.pilot.rules import advise
from trainer.pilot.thresholds import DEFAULT, Thresholds
from trainer.pilot.window import Window

N = 20   # the default window


def cfg_of(preset: str = "all", **knobs):
    cfg = config_mod.load(preset)
    for k, v in knobs.items():
        cfg.set(k.replace("__", "."), v)
    return cfg


def healthy(n: int = N) -> list[dict]:
    """A healthy window of the `all` preset (async eta 2, APRIL, GRESO alpha 0.25): no rule fires."""
    return [{"step": s,
             "async/max_staleness": 2, "async/staleness/max": s % 3,   # at eta 1 step in 3
             "async/generator_idle_frac": 0.05, "async/trainer_idle_frac": 0.1,
             "async/queue_size": 3, "actor/behave_imp_weight": 1.02, "actor/behave_capped_ratio": 0.0,
             "rollout/idle_slot_frac": 0.1, "april/buffer_size": 30 + (s % 2),
             "april/offpolicy_token_ratio": 0.1, "april/span_dropped_groups": 0,
             "rollout/truncated_ratio": 0.01, "rollout/response_len/mean": 50.0,
             "rollout/response_len/p90": 80.0, "rollout/zero_var_ratio": 0.25,
             "greso/p_easy": 0.5 + 0.01 * (s % 2), "greso/p_hard": 0.5, "greso/skip_rate": 0.1,
             "reward/mean": 0.4 + 0.01 * s, "reward/accuracy": 0.4 + 0.01 * s,
             "actor/kl": 0.02 + 0.001 * s, "actor/entropy": 0.5} for s in range(1, n + 1)]


def series(**columns) -> list[dict]:
    """The healthy window with some columns replaced: name=list of N values, or one value."""
    rows = healthy()
    for name, values in columns.items():
        key = name.replace("__", "/")
        for i, row in enumerate(rows):
            row[key] = values[i] if isinstance(values, list) else values
    return rows


def only(rows, cfg, rule):
    return rule(Window(rows), cfg, DEFAULT)


def fig(advice, name, stat):
    return next(f for f in advice.evidence if f.name == name and f.stat == stat)


def test_a_healthy_window_gets_no_advice():
    assert advise(healthy(), cfg_of()) == []
    assert advise(healthy(), cfg_of("demo")) == [] and advise(healthy(), cfg_of("async")) == []


# --- eta ----------------------------------------------------------------------------------------
STARVED = dict(async__staleness__max=2, async__generator_idle_frac=[0.2, 0.4] * 10,
               actor__behave_imp_weight=1.005)


def test_eta_is_raised_when_it_starves_generation_and_the_weights_stay_near_1():
    a = only(series(**STARVED), cfg_of(), staleness.eta_starves_generation)
    assert (a.knob, a.current, a.proposed, a.reason) == ("async.max_staleness", 2, 3,
                                                          "eta_starves_generation")
    assert fig(a, "async/staleness/max", "share of steps at eta").value == 1.0
    idle = fig(a, "async/generator_idle_frac", "mean")
    assert idle.value == pytest.approx(0.3) and (idle.first_step, idle.last_step) == (1, 20)
    assert fig(a, "actor/behave_imp_weight", "mean").value == pytest.approx(1.005)
    assert "raise eta from 2 to 3" in a.message and "100% of the steps" in a.message


@pytest.mark.parametrize("under", [
    {"async__staleness__max": [2] * 15 + [1] * 5},          # at eta 75% of steps (< 80%)
    {"async__generator_idle_frac": 0.19},                   # generator idle < 0.2
    {"actor__behave_imp_weight": 1.011},                    # |w - 1| not < 0.01: not "stable"
])
def test_eta_is_not_raised_just_under_the_thresholds(under):
    assert only(series(**{**STARVED, **under}), cfg_of(), staleness.eta_starves_generation) is None


def test_eta_is_not_raised_past_its_range_nor_when_auto_staleness_moves_it():
    assert only(series(**STARVED, async__max_staleness=64), cfg_of(async__max_staleness=64),
                staleness.eta_starves_generation) is None   # 65 is outside [0, 64]
    assert only(series(**STARVED), cfg_of(async__auto_staleness=True),
                staleness.eta_starves_generation) is None


def test_eta_is_lowered_when_the_behaviour_weights_drift():
    a = only(series(actor__behave_imp_weight=[1.06, 1.10] * 10), cfg_of(), staleness.eta_too_loose)
    assert (a.knob, a.current, a.proposed, a.reason) == ("async.max_staleness", 2, 1,
                                                          "behaviour_weights_drift")
    assert fig(a, "actor/behave_imp_weight", "mean").value == pytest.approx(1.08)
    # just under: |w - 1| = 0.049 and 0.9% capped
    assert only(series(actor__behave_imp_weight=1.049, actor__behave_capped_ratio=0.009), cfg_of(),
                staleness.eta_too_loose) is None
    a = only(series(actor__behave_capped_ratio=0.02), cfg_of(), staleness.eta_too_loose)
    assert a.proposed == 1 and fig(a, "actor/behave_capped_ratio", "mean").value == pytest.approx(0.02)


@pytest.mark.parametrize("imp,capped", [(1.0, 0.0), (1.005, 0.0), (1.03, 0.0), (1.06, 0.0),
                                        (0.93, 0.0), (1.0, 0.02), (1.0, 0.01)])
def test_the_eta_rule_agrees_with_auto_staleness(imp, capped):
    """At the same weights, async.auto_staleness lowers eta exactly when the pilot advises it,
    and counts a calm step exactly when the pilot may raise it: one verdict, in one place."""
    from trainer.rollout.asynchronous import AsyncDriver

    cfg = cfg_of(async__auto_staleness=True)
    auto = SimpleNamespace(_stable_steps=0)
    event = AsyncDriver.retune(auto, cfg, {"actor/behave_imp_weight": imp, "actor/behave_capped_ratio": capped})
    lowered = event is not None and event["changes"]["async.max_staleness"]["new"] == 1
    advice = only(series(actor__behave_imp_weight=imp, actor__behave_capped_ratio=capped),
                  cfg_of(), staleness.eta_too_loose)
    assert lowered == (advice is not None)
    raisable = only(series(**{**STARVED, "actor__behave_imp_weight": imp,
                              "actor__behave_capped_ratio": capped}),
                    cfg_of(), staleness.eta_starves_generation)
    assert (auto._stable_steps == 1) == (raisable is not None)


def test_eta_is_lowered_when_accuracy_fell_after_a_raise():
    rows = series(async__max_staleness=[2] * 10 + [3] * 10,
                  reward__accuracy=[0.6, 0.62] * 5 + [0.5, 0.52] * 5)
    a = only(rows, cfg_of(async__max_staleness=3), staleness.eta_raise_hurt)
    assert (a.knob, a.current, a.proposed) == ("async.max_staleness", 3, 2)
    assert fig(a, "reward/accuracy", "mean before the raise at step 11").value == pytest.approx(0.61)
    assert fig(a, "reward/accuracy", "mean from step 11").value == pytest.approx(0.51)
    # just under: a 0.04 fall
    rows = series(async__max_staleness=[2] * 10 + [3] * 10, reward__accuracy=[0.6] * 10 + [0.56] * 10)
    assert only(rows, cfg_of(async__max_staleness=3), staleness.eta_raise_hurt) is None


def test_eta_is_not_the_limit_when_the_trainer_waits_on_an_empty_queue():
    rows = series(async__trainer_idle_frac=[0.5, 0.7] * 10, async__queue_size=[0, 1] * 10)
    a = only(rows, cfg_of(), staleness.generation_is_the_limit)
    assert a.knob is None and a.proposed is None and "eta is not the limit" in a.message
    assert fig(a, "async/trainer_idle_frac", "mean").value == pytest.approx(0.6)
    assert fig(a, "async/queue_size", "mean").value == pytest.approx(0.5)
    # staleness s % 3 reaches eta = 2 at steps 2, 5, 8, 11, 14, 17, 20
    assert fig(a, "async/staleness/max", "share of steps at eta").value == pytest.approx(7 / 20)
    assert only(series(async__trainer_idle_frac=0.49, async__queue_size=0), cfg_of(),
                staleness.generation_is_the_limit) is None
    assert only(series(async__trainer_idle_frac=0.6, async__queue_size=1.0), cfg_of(),
                staleness.generation_is_the_limit) is None


# --- APRIL --------------------------------------------------------------------------------------
def test_idle_decode_slots_ask_for_more_over_sampling():
    a = only(series(rollout__idle_slot_frac=[0.3, 0.5] * 10), cfg_of(), april.idle_slots)
    # N' = 0 means 2 x 32 = 64; x 1.5 = 96
    assert (a.knob, a.current, a.proposed) == ("april.over_sampling_batch_size", 0, 96)
    assert fig(a, "rollout/idle_slot_frac", "mean").value == pytest.approx(0.4)
    assert only(series(rollout__idle_slot_frac=0.29), cfg_of(), april.idle_slots) is None


def test_a_growing_buffer_asks_for_less_over_sampling():
    grows = [30] * 15 + [31, 33, 36, 40, 45]        # grew at each of the last 5 steps
    a = only(series(april__buffer_size=grows), cfg_of(), april.too_much_over_sampling)
    assert (a.knob, a.current, a.proposed) == ("april.over_sampling_batch_size", 0, 48)   # 64 x 0.75
    assert fig(a, "april/buffer_size", "steps in a row it grew").value == 5
    assert fig(a, "april/buffer_size", "last").value == 45
    four = [30] * 16 + [33, 36, 40, 45]             # 4 rises in a row: under the threshold
    assert only(series(april__buffer_size=four), cfg_of(), april.too_much_over_sampling) is None


def test_off_policy_tokens_and_stale_drops_ask_for_less_over_sampling():
    a = only(series(april__offpolicy_token_ratio=[0.3, 0.4] * 10), cfg_of(), april.too_much_over_sampling)
    assert a.proposed == 48 and fig(a, "april/offpolicy_token_ratio", "mean").value == pytest.approx(0.35)
    assert only(series(april__offpolicy_token_ratio=0.29), cfg_of(), april.too_much_over_sampling) is None
    a = only(series(april__span_dropped_groups=[3, 5] * 10), cfg_of(), april.too_much_over_sampling)
    assert fig(a, "april/span_dropped_groups", "mean").value == 4   # 4 / 32 = 12.5% of a batch
    assert only(series(april__span_dropped_groups=3), cfg_of(),   # 9.4% of a batch
                april.too_much_over_sampling) is None
    # N' already the batch: answers span versions by their segments: a longer limit (128 -> 256)
    a = only(series(april__offpolicy_token_ratio=0.4), cfg_of(april__over_sampling_batch_size=32),
             april.too_much_over_sampling)
    assert (a.knob, a.current, a.proposed) == ("april.segment_max_tokens", 128, 256)
    # ... and nothing once a segment is a whole answer
    assert only(series(april__offpolicy_token_ratio=0.4), cfg_of(april__over_sampling_batch_size=32,
                april__segment_max_tokens=256), april.too_much_over_sampling) is None


def test_truncated_responses_ask_for_a_longer_limit_which_is_no_knob():
    a = only(series(rollout__truncated_ratio=[0.06, 0.1] * 10), cfg_of(), april.truncated)
    assert a.knob is None and "max_response_len = 256" in a.message and "512" in a.message
    assert fig(a, "rollout/truncated_ratio", "mean").value == pytest.approx(0.08)
    assert only(series(rollout__truncated_ratio=0.049), cfg_of(), april.truncated) is None


# a short segment limit: the `april` preset at a segment limit of 4 (reach 4 x 8 rounds x (5 + 1) =
# 192 tokens < max_response_len 256), 1,000 tokens generated a step, answers up to 202 tokens
SHORT_SEGMENT = dict(rollout__tokens__generated=1000, rollout__response_len__max=[100, 202] * 10)


def test_the_segment_limit_is_named_with_the_tokens_it_costs():
    cfg = cfg_of("april", april__segment_max_tokens=4)
    a = only(series(**SHORT_SEGMENT, rollout__waste__version_span=[40, 80] * 10), cfg,
             april.segment_limit_costs)
    # half of the longest answer (202 / 2); the span that lets 256 tokens finish: 256 / 32 - 1
    assert (a.knob, a.current, a.proposed, a.reason) == ("april.segment_max_tokens", 4, 101,
                                                          "segment_limit_too_short")
    assert "4 x 8 x 6 = 192 tokens" in a.message and "april.max_version_span 5 -> 7" in a.message
    assert "1,200 of 20,000 generated tokens (6%) were dropped for their version span" in a.message
    assert fig(a, "rollout/waste/version_span", "sum").value == 1200
    assert fig(a, "rollout/response_len/max", "max").value == 202
    # the rules of thumb, cited: N' 64 over a batch of 32, and the segment against 202 / 2
    assert "N' 64 is 2.0x the batch (rule of thumb 1.5-2x: 48-64)" in a.message
    assert "segment limit 4 against half of the longest response (202 tokens): 101" in a.message
    # just under: 980 of 20,000 (4.9%)
    assert only(series(**SHORT_SEGMENT, rollout__waste__version_span=49), cfg,
                april.segment_limit_costs) is None
    # a segment limit that lets every answer finish within the span (8 x 8 x 6 = 384) is no cause
    longer = cfg_of("april", april__segment_max_tokens=8)
    assert only(series(**SHORT_SEGMENT, rollout__waste__version_span=80), longer,
                april.segment_limit_costs) is None
    # ... unless steps end after 2 rounds on average: 8 x 2 x 6 = 96; span 256 / 16 - 1 = 15
    a = only(series(**SHORT_SEGMENT, rollout__waste__version_span=80, rollout__rounds=[1, 3] * 10),
             longer, april.segment_limit_costs)
    assert "8 x 2 x 6 = 96 tokens" in a.message and "april.max_version_span 5 -> 15" in a.message


def test_groups_at_their_last_chance_also_name_the_segment_limit():
    cfg = cfg_of("april", april__segment_max_tokens=4)
    a = only(series(**SHORT_SEGMENT, april__last_chance_groups=[6, 10] * 10), cfg,
             april.segment_limit_costs)   # 8 a step = a quarter of the batch
    assert a.proposed == 101 and "8.0 groups a step reached their last chance" in a.message
    assert fig(a, "april/last_chance_groups", "mean").value == 8
    assert only(series(**SHORT_SEGMENT, april__last_chance_groups=7.9), cfg,
                april.segment_limit_costs) is None


def test_when_the_segment_limit_is_the_cause_less_over_sampling_is_not_advised():
    """The issue's repro: span drops at a short segment limit used to propose a lower N'."""
    cfg = cfg_of("april", april__segment_max_tokens=4)
    rows = series(**SHORT_SEGMENT, rollout__waste__version_span=80, april__span_dropped_groups=5,
                  rollout__idle_slot_frac=0.6)
    assert [a.knob for a in advise(rows, cfg) if a.rule == "april"] == ["april.segment_max_tokens"]
    # at a segment limit long enough, the same drops are over-sampling's
    cfg = cfg_of("april", april__segment_max_tokens=8)
    assert [a.knob for a in advise(rows, cfg) if a.rule == "april"] == [
        "april.over_sampling_batch_size"]


# --- GRESO --------------------------------------------------------------------------------------
def test_greso_at_its_floor_with_too_many_zero_variance_groups_lowers_min_p():
    rows = series(rollout__zero_var_ratio=[0.4, 0.6] * 10, greso__p_easy=0.05, greso__p_hard=0.05)
    a = only(rows, cfg_of(), greso.target_out_of_reach)
    assert (a.knob, a.current, a.proposed) == ("greso.min_p", 0.05, 0.025)
    assert fig(a, "rollout/zero_var_ratio", "mean").value == pytest.approx(0.5)
    assert fig(a, "greso/p_easy", "share of steps at 0.05").value == 1.0
    # under: p_easy left the floor for one step; or a gap of 0.14 (< 0.15)
    assert only(series(rollout__zero_var_ratio=0.5, greso__p_easy=[0.05] * 19 + [0.06],
                       greso__p_hard=0.05), cfg_of(), greso.target_out_of_reach) is None
    assert only(series(rollout__zero_var_ratio=0.39, greso__p_easy=0.05, greso__p_hard=0.05),
                cfg_of(), greso.target_out_of_reach) is None


def test_greso_at_its_ceiling_with_few_zero_variance_groups_lowers_alpha():
    rows = series(rollout__zero_var_ratio=[0.04, 0.06] * 10, greso__p_easy=0.95, greso__p_hard=0.95)
    a = only(rows, cfg_of(), greso.target_out_of_reach)
    assert (a.knob, a.current, a.proposed) == ("greso.alpha", 0.25, 0.05)
    assert only(rows, cfg_of("async"), greso.target_out_of_reach) is None    # GRESO off


def test_most_skips_judged_wrong_raise_the_keep_floor():
    judged = [3] * 20                                   # 60 judged skips in the window
    wrong = [0.6, 0.4] * 10                             # pooled: (30 x 0.6 + 30 x 0.4) / 60 = 0.5
    a = only(series(greso__skips_judged=judged, greso__wrong_skip_ratio=wrong), cfg_of(), greso.wrong_skips)
    assert (a.knob, a.current, a.proposed, a.reason) == ("greso.p_floor", 0.01, 0.1, "wrong_skips")
    assert fig(a, "greso/wrong_skip_ratio", "share over the judged skips").value == pytest.approx(0.5)
    assert fig(a, "greso/skips_judged", "sum").value == 60
    # pooled by count: 2 steps of many right skips outweigh 18 steps of one wrong skip each
    counts = [1] * 18 + [20, 20]
    mostly_right = [1.0] * 18 + [0.0, 0.0]             # 18 wrong of 58: 31%
    assert only(series(greso__skips_judged=counts, greso__wrong_skip_ratio=mostly_right), cfg_of(),
                greso.wrong_skips) is None
    under = only(series(greso__skips_judged=judged, greso__wrong_skip_ratio=0.49), cfg_of(), greso.wrong_skips)
    assert under is None
    few = only(series(greso__skips_judged=[0] * 19 + [19], greso__wrong_skip_ratio=1.0), cfg_of(),
               greso.wrong_skips)                       # 19 judged: under min_judged_skips
    assert few is None


# --- health -------------------------------------------------------------------------------------
def test_length_growing_while_reward_is_flat_turns_on_the_overlong_penalty():
    rows = series(rollout__response_len__mean=[50.0] * 10 + [65.0] * 10, reward__mean=0.5)
    a = only(rows, cfg_of(), health.length_hacking)
    assert (a.knob, a.current, a.proposed) == ("algo.overlong_penalty", False, True)
    assert fig(a, "rollout/response_len/mean", "second half over first half - 1").value == pytest.approx(0.3)
    assert fig(a, "reward/mean", "second half minus first half").value == 0
    a = only(rows, cfg_of(algo__overlong_penalty=True), health.length_hacking)
    assert (a.knob, a.proposed) == ("optim.lr", pytest.approx(1e-4))
    # under: 18% longer; or reward up 0.03
    assert only(series(rollout__response_len__mean=[50.0] * 10 + [59.0] * 10, reward__mean=0.5),
                cfg_of(), health.length_hacking) is None
    assert only(series(rollout__response_len__mean=[50.0] * 10 + [65.0] * 10,
                       reward__mean=[0.5] * 10 + [0.53] * 10), cfg_of(), health.length_hacking) is None
    # the same 30% growth as the steps' noise: lengths 20 or 80 in turn, then 35 or 95
    # (means 50 -> 65); each half's sample variance 10 x 30^2 / 9 = 1000, Welch's standard error
    # sqrt(2 x 1000 / 10) = 14.1, two of it 28.3 > the 15 tokens of growth: no trend
    swinging = [20.0, 80.0] * 5 + [35.0, 95.0] * 5
    assert Window(series(rollout__response_len__mean=swinging)).halves_noise(
        "rollout/response_len/mean") == pytest.approx(28.28, abs=0.01)
    assert only(series(rollout__response_len__mean=swinging, reward__mean=0.5), cfg_of(),
                health.length_hacking) is None
    # the same swing with twice the growth (means 50 -> 80, 30 > 28.3) is one
    grown = [20.0, 80.0] * 5 + [50.0, 110.0] * 5
    assert only(series(rollout__response_len__mean=grown, reward__mean=0.5), cfg_of(),
                health.length_hacking).knob == "algo.overlong_penalty"


def test_entropy_collapse_raises_clip_high_then_the_temperature():
    rows = series(actor__entropy=[0.5] * 10 + [0.05] * 10)
    a = only(rows, cfg_of(algo__clip_high=0.2), health.entropy_collapse)
    assert (a.knob, a.current, a.proposed) == ("algo.clip_high", 0.2, 0.28)
    assert fig(a, "actor/entropy", "second-half mean over first-half mean").value == pytest.approx(0.1)
    a = only(rows, cfg_of(), health.entropy_collapse)     # clip_high already 0.28
    assert (a.knob, a.current, a.proposed) == ("rollout.temperature", 1.0, pytest.approx(1.2))
    assert only(rows, cfg_of(rollout__temperature=2.0), health.entropy_collapse) is None   # at its max
    # under: second half 0.13 (26% of the first, and above the 0.1 floor)
    assert only(series(actor__entropy=[0.5] * 10 + [0.13] * 10), cfg_of(), health.entropy_collapse) is None


def test_a_kl_runaway_raises_the_kl_coefficient_and_lowers_eta():
    rows = series(actor__kl=[0.1, 0.12] * 5 + [0.3, 0.32] * 5)
    a = only(rows, cfg_of(), health.kl_runaway)
    assert (a.knob, a.current, a.proposed) == ("algo.kl_coef", 0.0, 0.01)
    assert fig(a, "actor/kl", "median, first half").value == pytest.approx(0.11)
    assert fig(a, "actor/kl", "median, second half").value == pytest.approx(0.31)
    assert only(rows, cfg_of(algo__kl_coef=0.05), health.kl_runaway).proposed == pytest.approx(0.1)
    e = only(rows, cfg_of(), staleness.eta_too_loose)
    assert (e.reason, e.proposed) == ("kl_runaway", 1)
    # under: x1.9; or doubled but under 0.25
    assert only(series(actor__kl=[0.15] * 10 + [0.285] * 10), cfg_of(), health.kl_runaway) is None
    assert only(series(actor__kl=[0.1] * 10 + [0.24] * 10), cfg_of(), health.kl_runaway) is None
    # far past the limit: stop, not a knob
    a = only(series(actor__kl=[0.3] * 10 + [1.2] * 10), cfg_of(), health.kl_runaway)
    assert a.knob is None and a.message.startswith("stop")


# --- engine-trainer mismatch ----------------------------------------------------------------
# a bfloat16 engine against the float32 trainer, as measured (demo preset, CPU, steps 1-12):
# healthy, however noisy (one step at 1.8e-4)
BF16_KL = [5.69e-05, 2.77e-05, 4.24e-05, 4.76e-05, 2.43e-05, 5.23e-05, 4.64e-05, 4.63e-05,
           7.61e-05, 1.826e-04, 9.79e-05, 3.81e-05]
BF16_MAX = [0.193, 0.057, 0.134, 0.1, 0.068, 0.104, 0.103, 0.098, 0.208, 0.597, 0.282, 0.108]


def measured(kl, *, outside=0.0, n=N, **more) -> list[dict]:
    """A synchronous run's rows with the mismatch figures: kl one value or a list of n (cycled)."""
    kls = kl if isinstance(kl, list) else [kl]
    rows = []
    for i, row in enumerate(healthy(n)):
        row.update({"mismatch/kl": kls[i % len(kls)], "mismatch/outside_band_ratio": outside,
                    "mismatch/abs_logp_diff_max": BF16_MAX[i % len(BF16_MAX)],
                    **{k.replace("__", "/"): (v[i] if isinstance(v, list) else v)
                       for k, v in more.items()}})
        rows.append(row)
    return rows


def corrected(kl, zeroed=0.0, **kw) -> list[dict]:
    """Rows of steps with the correction on (it reports its weight and what it dropped)."""
    return measured(kl, mismatch__correction_weight=1.0, mismatch__correction_zeroed_ratio=zeroed,
                    **kw)


def mismatch_advice(rows, cfg):
    return [a for a in advise(rows, cfg) if a.rule == "mismatch"]


def test_a_high_mismatch_with_nothing_correcting_it_turns_the_correction_on():
    kl = [1.5e-3, 2.5e-3] * 10
    a = only(measured(kl), cfg_of("demo"), mismatch.mismatch_uncorrected)
    assert (a.rule, a.reason, a.knob, a.current, a.proposed) == (
        "mismatch", "mismatch_high", "mismatch.correction", "off", "truncate")
    median = fig(a, "mismatch/kl", "median")
    assert median.value == pytest.approx(2e-3) and (median.first_step, median.last_step) == (1, 20)
    assert fig(a, "mismatch/kl", "last").value == 2.5e-3
    assert fig(a, "mismatch/outside_band_ratio", "mean").value == 0.0
    assert "median KL(pi_rollout || pi_old) 0.002" in a.message and "truncate" in a.message
    assert propose(a.knob, a.proposed) == "truncate"                    # a knob, in its choices
    assert [x.knob for x in mismatch_advice(measured(kl), cfg_of("demo"))] == ["mismatch.correction"]


def test_tokens_outside_the_band_or_a_rising_kl_turn_the_correction_on_too():
    a = only(measured(1e-4, outside=0.02), cfg_of("demo"), mismatch.mismatch_uncorrected)
    assert (a.reason, a.proposed) == ("mismatch_high", "truncate")
    assert fig(a, "mismatch/outside_band_ratio", "mean").value == pytest.approx(0.02)
    assert "2.0% of the tokens" in a.message
    # under the level limit all along, but its median quadruples past the rise floor
    a = only(measured([2e-4] * 10 + [8e-4] * 10), cfg_of("demo"), mismatch.mismatch_uncorrected)
    assert (a.reason, a.proposed) == ("mismatch_rising", "truncate")
    assert fig(a, "mismatch/kl", "median, first half").value == pytest.approx(2e-4)
    assert fig(a, "mismatch/kl", "median, second half").value == pytest.approx(8e-4)


@pytest.mark.parametrize("rows", [
    measured(9e-4),                                   # just under the level limit
    measured(1e-4, outside=0.009),                    # just under the outside-band limit
    measured([2.4e-4] * 10 + [4.9e-4] * 10),          # doubled, but under the rise floor
    measured([3e-4] * 10 + [5.9e-4] * 10),            # over the floor, but x1.97
    measured(BF16_KL),                                # a bfloat16 engine, as measured
    measured(1e-9),                                   # a float32 engine, as measured
    measured(2e-3, n=4),                              # fewer than min_steps measured steps
    healthy(),                                        # no mismatch figures: a run before them
])
def test_the_mismatch_rules_are_silent_under_their_limits_and_without_figures(rows):
    for cfg in (cfg_of("demo"), cfg_of("demo", mismatch__correction="truncate"),
                cfg_of("demo", rollout__dtype="bfloat16", mismatch__correction="mask")):
        with_weights = [dict(r, **{"mismatch/correction_weight": 1.0}) if "mismatch/kl" in r else r
                        for r in rows]
        assert mismatch_advice(rows, cfg) == [] and mismatch_advice(with_weights, cfg) == []


def test_still_high_with_the_correction_on_raises_the_engines_precision_by_a_fork():
    cfg = cfg_of("demo", rollout__dtype="bfloat16", mismatch__correction="truncate")
    assert only(corrected(2e-3), cfg, mismatch.mismatch_uncorrected) is None    # it is on already
    a = only(corrected(2e-3), cfg, mismatch.mismatch_despite_correction)
    assert (a.rule, a.reason, a.knob, a.proposed, a.confidence) == (
        "mismatch", "mismatch_high", None, None, "medium")
    assert "from bfloat16 to float32" in a.message and "--set rollout.dtype=float32" in a.message
    assert "mismatch.correction = truncate at token level" in a.message
    assert "mismatch.level = geometric" in a.message                  # the algorithm-level way
    assert fig(a, "mismatch/kl", "median").value == pytest.approx(2e-3)
    # "still": only the steps the correction was on count; three of them are not enough
    rows = measured(2e-3)
    for r in rows[-3:]:
        r["mismatch/correction_weight"] = 1.0
    assert only(rows, cfg, mismatch.mismatch_despite_correction) is None
    # rising, with the correction on
    a = only(corrected([2e-4] * 10 + [8e-4] * 10), cfg, mismatch.mismatch_despite_correction)
    assert a.reason == "mismatch_rising"
    # asked for by advise, as a note: the autopilot never acts on it
    assert [(x.reason, x.knob) for x in mismatch_advice(corrected(2e-3), cfg)] == [
        ("mismatch_high", None)]


def test_a_correction_that_drops_many_tokens_raises_the_engines_precision():
    cfg = cfg_of("demo", rollout__dtype="float16", mismatch__correction="mask")
    a = only(corrected(5e-5, zeroed=0.08), cfg, mismatch.mismatch_despite_correction)
    assert (a.reason, a.knob) == ("correction_drops_tokens", None)
    assert fig(a, "mismatch/correction_zeroed_ratio", "mean").value == pytest.approx(0.08)
    assert "drops 8.0% of the tokens" in a.message and "from float16 to float32" in a.message
    assert only(corrected(5e-5, zeroed=0.049), cfg, mismatch.mismatch_despite_correction) is None
    # already geometric masking: no need to suggest it
    geo = cfg_of("demo", rollout__dtype="float16", mismatch__correction="mask",
                 mismatch__level="geometric")
    assert "mismatch.level = geometric" not in only(corrected(5e-5, zeroed=0.08), geo,
                                                    mismatch.mismatch_despite_correction).message


@pytest.mark.parametrize("engine", ["auto", "float32"])
def test_an_engine_at_full_precision_points_to_the_kernels_not_the_engines_dtype(engine):
    cfg = cfg_of("demo", rollout__dtype=engine, mismatch__correction="truncate")
    a = only(corrected(2e-3), cfg, mismatch.mismatch_despite_correction)
    assert (a.knob, a.confidence) == (None, "low")
    assert "kernels" in a.message and "from bfloat16" not in a.message
    assert ("in float32" if engine == "float32" else "at the trainer's precision") in a.message


def test_runs_with_versions_read_the_age_0_mismatch_alone():
    # APRIL: older tokens add the policy's drift to mismatch/kl and to the outside-band share;
    # the engine's own figure is age 0's
    drift = measured(5e-3, outside=0.2, mismatch__age0__kl=5e-5, mismatch__age1__kl=1e-2)
    assert mismatch_advice(drift, cfg_of("april")) == []
    a = only(measured(5e-5, mismatch__age0__kl=2e-3), cfg_of("april"), mismatch.mismatch_uncorrected)
    assert (a.knob, a.proposed) == ("mismatch.correction", "truncate")
    assert fig(a, "mismatch/age0/kl", "median").value == pytest.approx(2e-3)
    assert not any(f.name == "mismatch/outside_band_ratio" for f in a.evidence)


def test_asynchronous_runs_count_the_behaviour_weight_as_the_correction():
    rows = measured(5e-5, mismatch__age0__kl=2e-3)
    # pi_prox recomputed: the decoupled loss weights each token by pi_prox / pi_b already
    cfg = cfg_of("async", rollout__dtype="bfloat16", async__prox_logp="recompute")
    assert only(rows, cfg, mismatch.mismatch_uncorrected) is None
    a = only(rows, cfg, mismatch.mismatch_despite_correction)
    assert a.knob is None and "behaviour weight" in a.message and "rollout.dtype=float32" in a.message
    # pi_prox interpolated (the preset's): nothing corrects it, and the correction needs a fork
    # (checks.py refuses it with loglinear)
    cfg = cfg_of("async", async__prox_logp="loglinear")
    a = only(rows, cfg, mismatch.mismatch_uncorrected)
    assert a.knob is None and "--set async.prox_logp=recompute" in a.message
    assert only(rows, cfg, mismatch.mismatch_despite_correction) is None

# --- the whole ----------------------------------------------------------------------------------
def test_advise_reads_the_latest_window_and_keys_are_stable():
    rows = healthy() + [{**r, "step": r["step"] + N} for r in series(**STARVED)]
    got = advise(rows, cfg_of())                                     # the latest 20: starved
    assert [a.reason for a in got] == ["eta_starves_generation"]
    assert {(f.first_step, f.last_step) for f in got[0].evidence} == {(21, 40)}
    # over 40 steps, eta is at the bound in (7 + 20) / 40 = 68% of them: no advice
    assert advise(rows, cfg_of(), window=40) == []
    a1 = advise(series(**STARVED), cfg_of())[0]
    a2 = advise(series(**{**STARVED, "async__generator_idle_frac": 0.5}), cfg_of())[0]
    assert a1.evidence_key == a2.evidence_key                        # same move, same conditions
    a3 = advise(series(**{**STARVED, "async__staleness__max": 3}, async__max_staleness=3),
                cfg_of(async__max_staleness=3))[0]
    assert a3.evidence_key != a1.evidence_key                        # from another value
    with pytest.raises(ValueError, match="window"):
        advise(rows, cfg_of(), window=0)


def test_proposals_stay_in_range_and_on_knobs():
    assert propose("async.max_staleness", 99) == 64 and propose("rollout.temperature", -1) == 0.05
    with pytest.raises(ValueError, match="not a tunable knob"):
        propose("rollout.max_response_len", 512)


def test_every_threshold_has_a_source():
    for t in Thresholds.describe():
        assert t["help"] and t["source"], t["name"]


def test_nan_and_missing_values_are_skipped():
    rows = series(**STARVED)
    rows[3]["async/generator_idle_frac"] = "nan"
    del rows[4]["async/generator_idle_frac"]
    a = only(rows, cfg_of(), staleness.eta_starves_generation)
    idle = fig(a, "async/generator_idle_frac", "mean")
    assert idle.value == pytest.approx((0.3 * 20 - 0.4 - 0.2) / 18)


# --- the command --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run_dir(tmp_path_factory):
    from trainer.observe.metrics import JsonlSink
    from trainer.run.runner import Runner

    d = tmp_path_factory.mktemp("advise") / "run"
    cfg = config_mod.load("demo", list(TINY_RUN) + ["run.max_steps=3"])
    sink = JsonlSink(d)
    with Runner(cfg, d, sink=sink, system_telemetry=False) as runner:
        runner.run()
    return d


def test_advise_prints_json_for_a_real_run_directory(tiny_run_dir, capsys):
    assert cli.main(["advise", str(tiny_run_dir), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["window"] == N and out["steps"] == [1, 3] and isinstance(out["advice"], list)
    for a in out["advice"]:
        assert {"rule", "knob", "current", "proposed", "evidence", "evidence_key", "confidence"} <= set(a)
    assert cli.main(["advise", str(tiny_run_dir), "--window", "2"]) == 0
    assert "steps 2-3" in capsys.readouterr().out


def test_advise_says_what_is_wrong_with_a_run_directory(tiny_run_dir, tmp_path, capsys):
    assert cli.main(["advise", str(tmp_path / "nope")]) == 2
    assert "no such directory or file" in capsys.readouterr().err
    assert cli.main(["advise", str(tmp_path)]) == 2
    assert "has no config.toml: not a run directory" in capsys.readouterr().err
    assert cli.main(["advise", str(tiny_run_dir), "--window", "0"]) == 2
    assert "--window: must be at least 1" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.toml").write_text((tiny_run_dir / "config.toml").read_text())
    assert cli.main(["advise", str(bad)]) == 2     # a dashboard run's directory: no metrics.jsonl
    assert "has no metrics.jsonl; a dashboard run keeps its metrics in the database: pass its " \
        "JSON export" in capsys.readouterr().err
    assert cli.main(["advise", str(bad / "config.toml")]) == 2
    assert "not a run directory, nor a JSON export" in capsys.readouterr().err
    (tmp_path / "x.json").write_text('{"config": {}}')
    assert cli.main(["advise", str(tmp_path / "x.json")]) == 2
    assert "not a dashboard JSON export" in capsys.readouterr().err
    (bad / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    assert cli.main(["advise", str(bad)]) == 2
    assert "metrics.jsonl, line 2: not JSON" in capsys.readouterr().err
    (bad / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "reward/me')   # a live run's last line
    assert cli.main(["advise", str(bad)]) == 0
    assert "no advice over steps 1-1" in capsys.readouterr().out
    (bad / "config.toml").write_text("[optim]\nlr = 7\n")
    assert cli.main(["advise", str(bad)]) == 2
    assert "optim.lr" in capsys.readouterr().err



@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """A real short CPU run whose engine computes in bfloat16 against the float32 trainer, with
    the mask correction on (so both rules read its rows): its config and metric rows."""
    from trainer.observe.metrics import MemorySink
    from trainer.run.runner import Runner

    cfg = config_mod.load("demo", list(TINY_RUN) + ["rollout.dtype=bfloat16",
                                                   "mismatch.correction=mask", "run.max_steps=10"])
    sink = MemorySink()
    with Runner(cfg, tmp_path_factory.mktemp("bf16"), sink=sink, system_telemetry=False) as runner:
        runner.run()
    return cfg, sink.steps


def test_a_real_bfloat16_engine_is_healthy_to_the_mismatch_rules(bf16_run):
    import dataclasses
    import statistics

    cfg, rows = bf16_run
    measured_rows = [r for r in rows if "mismatch/kl" in r]
    kl = [r["mismatch/kl"] for r in measured_rows]
    # guard: the run measured a real gap, on enough steps for the rules to read (a float32
    # engine: kl about 1e-9, |d log p| at most about 1e-5)
    assert len(kl) >= DEFAULT.min_steps and min(kl) > 0, kl
    assert max(r["mismatch/abs_logp_diff_max"] for r in measured_rows) > 1e-3
    assert all("mismatch/correction_zeroed_ratio" in r for r in measured_rows)
    uncorrected = config_mod.load("demo", list(TINY_RUN) + ["rollout.dtype=bfloat16"])
    for c in (cfg, uncorrected):              # the same rows, read as corrected and as not
        assert mismatch_advice(rows, c) == []
    # and the rules do read these rows: with the KL limit under their own median, each advises
    low = dataclasses.replace(DEFAULT, mismatch_kl_high=statistics.median(kl) / 2)
    a = mismatch.mismatch_uncorrected(Window(rows), uncorrected, low)
    assert (a.knob, a.proposed) == ("mismatch.correction", "truncate")
    assert fig(a, "mismatch/kl", "median").value == pytest.approx(statistics.median(kl))
    a = mismatch.mismatch_despite_correction(Window(rows), cfg, low)
    assert a.reason == "mismatch_high" and "--set rollout.dtype=float32" in a.message

def test_the_docs_list_every_threshold_with_its_default_and_source():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "pilot.md").read_text()
    for t in Thresholds.describe():
        assert f"| `{t['name']}` | {t['default']:g} |" in page and t["source"] in page, t["name"]


def test_aprils_rule_figures_are_computed_once_with_the_defaults_read_as_the_rollout_reads_them():
    """N' and the segment limit in effect (0: 2 x the batch, half of max_response_len, as
    trainer/rollout/april.py reads them) beside the rules of thumb; the run page's line and the
    advice both take these figures."""
    cfg = config_mod.apply_overrides(config_mod.load("demo"), {
        "april.enabled": True, "rollout.rollout_batch_size": 4, "rollout.n_samples_per_prompt": 4,
        "rollout.max_response_len": 96, "april.over_sampling_batch_size": 0, "april.segment_max_tokens": 0})
    f = april.rule_figures(cfg, longest=201, mean=20.0)
    assert (f["over_sampling"], f["ratio"], f["rule_batch"], f["segment"]) == (8, 2.0, (6, 8), 48)
    assert (f["first_segment"], f["over_sampled_samples"], f["buffer_sizing"]) == (101, 16, 320)
    none = april.rule_figures(config_mod.apply_overrides(cfg, {"april.over_sampling_batch_size": 4}))
    assert (none["first_segment"], none["over_sampled_samples"], none["buffer_sizing"]) == (None, 0, None)
