"""The training–inference mismatch: its figures and the correction's weights by hand, their
composition with APRIL's version TIS and AReaL's decoupled loss, and real engines in float32
and bfloat16 (trainer/algo/rollout_correction.py, trainer/algo/objective.py)."""
import math

import pytest
import torch
from helpers import TINY_RUN, full_forward_logprobs

from trainer import config as C
from trainer.algo import decoupled, grpo, objective
from trainer.algo import rollout_correction as rc
from trainer.engine.base import Sample, SamplingParams
from trainer.rollout.base import Group
from trainer.tasks.base import Problem

E = math.exp
# two sequences of 3 and 2 response tokens; d = log pi_old - log pi_rollout
OLD = [[-1.0, -2.0, -0.5], [-1.0, -1.0]]
ROLLOUT = [[-1.5, -1.0, -0.5], [-0.5, -1.5]]      # d = [0.5, -1, 0], [-0.5, 0.5]


def weights(mode, level, lower, upper):
    old, mask = rc.padded(OLD)
    roll, _ = rc.padded(ROLLOUT)
    w = rc.weights(old, roll, mask, rc.Correction(mode, level, lower, upper))
    return [w[0].tolist(), w[1, :2].tolist()]


@pytest.mark.parametrize("mode,level,lower,upper,want", [
    # token: rho = e^0.5, e^-1, 1 | e^-0.5, e^0.5
    ("truncate", "token", 0.5, 1.5, [[1.5, E(-1), 1.0], [E(-0.5), 1.5]]),
    ("mask", "token", 0.5, 1.5, [[0.0, 0.0, 1.0], [E(-0.5), 0.0]]),
    ("band", "token", 0.5, 1.5, [[0.0, 0.0, 1.0], [1.0, 0.0]]),
    # sequence: the product, e^-0.5 for the first, e^0 for the second, on every token
    ("truncate", "sequence", 0.5, 1.5, [[E(-0.5)] * 3, [1.0, 1.0]]),
    ("mask", "sequence", 0.7, 1.5, [[0.0] * 3, [1.0, 1.0]]),
    ("band", "sequence", 0.5, 1.5, [[1.0] * 3, [1.0, 1.0]]),
    # geometric: e^(-0.5 / 3) and e^0
    ("truncate", "geometric", 0.5, 1.0, [[E(-0.5 / 3)] * 3, [1.0, 1.0]]),
    ("mask", "geometric", 0.9, 1.5, [[0.0] * 3, [1.0, 1.0]]),
    ("mask", "geometric", 0.8, 1.5, [[E(-0.5 / 3)] * 3, [1.0, 1.0]]),
    ("off", "token", 0.5, 1.5, [[1.0] * 3, [1.0, 1.0]]),
])
def test_weights_by_hand(mode, level, lower, upper, want):
    got = weights(mode, level, lower, upper)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-9)


def test_padding_gets_no_weight_and_a_long_sequence_does_not_overflow():
    old, mask = rc.padded([[0.0] * 4000, [0.0]])
    roll, _ = rc.padded([[-1.0] * 4000, [0.0]])   # sum d = 4000: e^4000 is inf in float64
    w = rc.weights(old, roll, mask, rc.Correction("truncate", "sequence", 0.5, 3.0))
    assert w[0].tolist() == [3.0] * 4000 and w[1, 0] == 1.0 and float(w[1, 1:].abs().sum()) == 0.0
    w = rc.weights(old, roll, mask, rc.Correction("mask", "sequence", 0.5, 3.0))
    assert float(w[0].sum()) == 0.0 and torch.isfinite(w).all()


def test_a_nan_or_infinite_log_probability_gets_no_weight_and_leaves_no_nan():
    nan, inf = float("nan"), float("inf")
    old, mask = rc.padded([[0.0, 0.0, 0.0], [0.0]])
    roll, _ = rc.padded([[-1.0, nan, -0.5], [-inf]])   # d = 1, nan, 0.5 | +inf
    for mode in ("truncate", "mask", "band"):
        for level in ("token", "sequence", "geometric"):
            w = rc.weights(old, roll, mask, rc.Correction(mode, level, 0.5, 2.0))
            assert not torch.isnan(w).any(), (mode, level)
            assert w[0, 1] == 0.0 and float(w[1, 1:].abs().sum()) == 0.0
    w = rc.weights(old, roll, mask, rc.Correction("truncate", "token", 0.5, 2.0))
    assert w[0].tolist() == pytest.approx([2.0, 0.0, E(0.5)]) and w[1, 0] == 2.0


def test_a_band_that_excludes_one_is_refused():
    with pytest.raises(ValueError, match="band must hold 1"):
        rc.Correction("mask", "token", 1.2, 2.0)
    with pytest.raises(ValueError, match="level"):
        rc.Correction("mask", "tokens", 0.5, 2.0)
    with pytest.raises(C.ConfigError, match="only a ratio of exactly 1"):
        C.load("demo", ["mismatch.correction=band", "mismatch.lower=1", "mismatch.upper=1"])
    C.load("demo", ["mismatch.correction=truncate", "mismatch.lower=1", "mismatch.upper=1"])


def test_figures_by_hand():
    old, mask = rc.padded(OLD)
    roll, _ = rc.padded(ROLLOUT)
    f = rc.figures(old, roll, mask, lower=0.5, upper=1.5)
    k3 = [E(0.5) - 1.5, E(-1) - 1 + 1, 0.0, E(-0.5) - 1 + 0.5, E(0.5) - 1.5]
    assert f["kl"] == pytest.approx(sum(k3) / 5)
    assert f["kl_k1"] == pytest.approx(-(0.5 - 1 + 0 - 0.5 + 0.5) / 5)       # 0.1
    assert f["abs_logp_diff"] == pytest.approx(2.5 / 5) and f["abs_logp_diff_max"] == 1.0
    assert f["outside_band_ratio"] == pytest.approx(3 / 5) and f["tokens"] == 5
    assert rc.sequence_log_ratios(old, roll, mask) == pytest.approx([-0.5, 0.0])
    ages, _ = rc.padded([[0, 1, 2], [0, 0]])
    by_age = rc.figures_by_age(old, roll, mask, ages)
    assert by_age["age0/kl"] == pytest.approx((k3[0] + k3[3] + k3[4]) / 3)
    assert by_age["age0/abs_logp_diff"] == pytest.approx(0.5)
    assert by_age["age1/kl"] == pytest.approx(k3[1]) and by_age["age1/abs_logp_diff"] == 1.0
    assert by_age["age2plus/kl"] == 0.0
    # the largest |d| per age: the engine's own (age 0) apart from the drift of older tokens
    assert (by_age["age0/abs_logp_diff_max"], by_age["age1/abs_logp_diff_max"],
            by_age["age2plus/abs_logp_diff_max"]) == (0.5, 1.0, 0.0)
    assert rc.figures(old, roll, torch.zeros_like(mask), lower=0.5, upper=1.5) == {}


def test_importance_weights_scale_the_surrogate_alone():
    """grpo.token_loss with is_weights: each token's clipped surrogate times its weight; the KL
    penalty and the token count untouched."""
    logp = torch.tensor([-1.0, -2.0])
    old = torch.tensor([-1.1, -1.9])
    ref = torch.tensor([-1.2, -2.2])
    adv, w, isw = torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.0]), torch.tensor([2.0, 0.5])
    loss, _ = grpo.token_loss(logp, old, adv, w, clip_low=0.2, clip_high=0.28, ref_logp=ref,
                              kl_coef=0.1, is_weights=isw, total_tokens=2.0)
    r = torch.exp(logp - old)   # e^0.1 (inside the clip range), e^-0.1
    pg = [-float(r[0]) * 2.0, -float(r[1]) * 0.5]
    kl = [float(grpo.kl_k3(logp, ref)[i]) for i in range(2)]
    assert float(loss) == pytest.approx((pg[0] + 0.1 * kl[0] + pg[1] + 0.1 * kl[1]) / 2)


def test_the_decoupled_loss_without_its_behaviour_weight_is_grpo_centred_on_prox():
    logp, prox = torch.tensor([-1.0, -2.0]), torch.tensor([-1.1, -1.9])
    behave = torch.tensor([-3.0, -0.5])   # far: its weight would be masked or capped
    adv, w, isw = torch.tensor([1.0, -1.0]), torch.ones(2), torch.tensor([0.7, 1.3])
    got, stats = decoupled.token_loss(logp, prox, behave, adv, w, clip_low=0.2, clip_high=0.28,
                                      cap=2.0, cap_mode="none", total_tokens=2.0, is_weights=isw)
    want, _ = grpo.token_loss(logp, prox, adv, w, clip_low=0.2, clip_high=0.28,
                              is_weights=isw, total_tokens=2.0)
    assert float(got) == pytest.approx(float(want))
    # the first token's pi_prox / pi_b = e^1.9 is over the cap: not applied, still reported
    # (async.auto_staleness and the pilot read that share)
    assert float(stats["behave_capped"]) == 1.0
    assert float(stats["behave_imp_weight"]) == pytest.approx(E(1.9) + E(-1.4))  # still reported


# --- the objective: who owns which ratio ----------------------------------------------------------

def _group(cfg_versions=((4, 4), (3, 4))):
    def sample(versions):
        s = Sample([5, 6], SamplingParams())
        s.response_ids, s.logprobs, s.versions = [7, 8], [-1.0, -2.0], list(versions)
        return s

    return Group(problem=Problem(id="p", prompt="[1]=", answer=1, kind="sum"),
                 samples=[sample(v) for v in cfg_versions], rewards=[1.0, 0.0])


def _trainer(seqs):   # the trainer's log-probabilities, made up: d = [0.5, -0.5] on every sample
    return [[-0.5, -2.5] for _ in seqs]


def _objective(*overrides):
    cfg = C.load("demo", list(overrides))
    return objective.train_sequences([_group()], cfg, 4, _trainer)


def test_measuring_leaves_the_loss_as_it_was_and_reports_the_figures():
    """Correction off: pi_old stays the engine's; the figures and the histogram are there."""
    got = _objective()
    assert [q.old_logprobs for q in got.seqs] == [[-1.0, -2.0]] * 2
    assert all(q.is_weights is None for q in got.seqs)
    assert got.metrics["mismatch/abs_logp_diff"] == pytest.approx(0.5)
    assert got.metrics["mismatch/kl"] == pytest.approx((E(0.5) - 1.5 + E(-0.5) - 0.5) / 2)
    values, edges = got.histograms["mismatch/seq_log_ratio"]
    assert values == pytest.approx([0.0, 0.0]) and edges[0] == -1.0 and edges[-1] == 1.0 and 0.0 in edges
    assert "mismatch/age0/kl" not in got.metrics   # one version: no age split (APRIL is off)
    off = _objective("mismatch.measure=false")
    assert not any(k.startswith("mismatch/") for k in off.metrics) and not off.histograms


def test_the_correction_takes_pi_old_from_the_trainer_and_weights_every_token():
    got = _objective("mismatch.correction=truncate", "mismatch.upper=1.5")
    for q in got.seqs:
        assert q.old_logprobs == [-0.5, -2.5]
        assert q.is_weights == pytest.approx([1.5, E(-0.5)]) and q.weights == [1.0, 1.0]
    assert got.metrics["mismatch/correction_weight"] == pytest.approx((1.5 + E(-0.5)) / 2)
    assert got.metrics["mismatch/correction_truncated_ratio"] == pytest.approx(0.5)


def test_a_masked_token_leaves_the_loss_and_a_masked_sequence_is_not_trained():
    got = _objective("mismatch.correction=mask", "mismatch.upper=1.5")
    assert [q.weights for q in got.seqs] == [[0.0, 1.0]] * 2
    assert got.metrics["mismatch/correction_zeroed_ratio"] == pytest.approx(0.5)
    # the sequence's product is e^0: kept whole; the band [0.5, 0.9] excludes it: dropped
    kept = _objective("mismatch.correction=mask", "mismatch.level=sequence")
    assert len(kept.seqs) == 2 and kept.seqs[0].is_weights == pytest.approx([1.0, 1.0])
    assert _objective("mismatch.correction=band", "mismatch.level=sequence",
                      "mismatch.upper=1.1", "mismatch.lower=0.9").seqs != []
    assert _objective("mismatch.correction=band", "mismatch.level=token",
                      "mismatch.upper=1.2", "mismatch.lower=0.9").seqs == []


@pytest.mark.parametrize("mode", ["tis", "as_is", "mask"])
def test_measuring_never_changes_an_april_loss(mode):
    """With the correction off, the default (measuring) trains exactly what measure=false does:
    a fresh sample's pi_old stays the engine's under TIS, the stale one's is the trainer's."""
    base = ["april.enabled=true", f"april.offpolicy={mode}"]
    on, off = _objective(*base), _objective(*base, "mismatch.measure=false")
    assert [(q.old_logprobs, q.weights, q.is_weights) for q in on.seqs] == \
        [(q.old_logprobs, q.weights, q.is_weights) for q in off.seqs]
    assert on.seqs[0].old_logprobs == [-1.0, -2.0]            # fresh: the engine's
    assert "mismatch/kl" in on.metrics and "mismatch/kl" not in off.metrics


def test_with_april_the_correction_replaces_its_version_tis_never_multiplies_it():
    """APRIL's TIS weight of an age-1 token is min(pi_current / pi_b, cap) = e^0.5: the same
    ratio the correction weighs. With the correction on, that token's loss weight is 1 and its
    importance weight the correction's alone; APRIL's decay (not a ratio) still applies."""
    tis = _objective("april.enabled=true", "april.offpolicy=tis", "april.tis_cap=2.0")
    stale = tis.seqs[1]
    assert stale.weights == [1.0, 1.0] and stale.is_weights == pytest.approx([E(0.5), 1.0])
    assert tis.metrics["mismatch/age1/abs_logp_diff"] == pytest.approx(0.5)   # its first token
    both = _objective("april.enabled=true", "april.offpolicy=tis", "april.tis_cap=2.0",
                      "april.decay=0.9", "mismatch.correction=truncate", "mismatch.upper=1.5")
    stale = both.seqs[1]
    assert stale.weights == [1.0, 1.0]
    # the correction's, once, times decay^age (not a ratio: it stays)
    assert stale.is_weights == pytest.approx([1.5 * 0.9, E(-0.5)])
    masked = _objective("april.enabled=true", "april.offpolicy=mask",
                        "mismatch.correction=truncate", "mismatch.upper=1.5")
    assert masked.seqs[1].weights == [0.0, 1.0]                # APRIL's mask stays


def test_aprils_version_weight_scales_the_surrogate_not_the_kl_or_the_token_count():
    """APRIL's TIS weight and decay of an age-1 token go to the surrogate alone (is_weights): the
    loss mask stays 1, so the token mean's count and the KL penalty are the plain ones (the
    weight e^0.5 x 0.9 went into `weights` and scaled both before). The loss, by hand, with
    the learner's aggregation (total_tokens = sum of the mask)."""
    got = _objective("april.enabled=true", "april.offpolicy=tis", "april.tis_cap=2.0",
                     "april.decay=0.9")
    stale = got.seqs[1]       # versions (3, 4) at version 4; pi_old the trainer's: [-0.5, -2.5]
    assert stale.weights == [1.0, 1.0]
    assert stale.is_weights == pytest.approx([E(0.5) * 0.9, 1.0])
    logp, ref = torch.tensor([-0.4, -2.5]), torch.tensor([-0.6, -2.0])
    old, adv = torch.tensor(stale.old_logprobs), torch.tensor([stale.advantage] * 2)
    loss, _ = grpo.token_loss(logp, old, adv, torch.tensor(stale.weights), clip_low=0.2,
                              clip_high=0.28, ref_logp=ref, kl_coef=0.1,
                              is_weights=torch.tensor(stale.is_weights),
                              total_tokens=sum(stale.weights))
    a = stale.advantage           # r = e^0.1 (inside the clip range) and 1
    pg = [-a * E(0.1), -a]
    kl = [E(-0.2) + 0.2 - 1, E(0.5) - 0.5 - 1]
    want = (E(0.5) * 0.9 * pg[0] + 0.1 * kl[0] + pg[1] + 0.1 * kl[1]) / 2
    assert float(loss) == pytest.approx(want)


def test_a_truncated_weight_that_underflows_is_a_weight_not_a_rejection():
    """Truncate rejects nothing: at the sequence level a product that underflows to 0 weighs the
    surrogate by 0, the tokens stay in the loss mask and the token count (KL penalty included)
    and are not counted as masked (they left the loss and the ledger called them mismatch)."""
    far = lambda seqs: [[-1000.0, -1000.0] for _ in seqs]   # noqa: E731  d ~ -1000 per token
    cfg = C.load("demo", ["mismatch.correction=truncate", "mismatch.level=sequence"])
    got = objective.train_sequences([_group()], cfg, 4, far)
    assert len(got.seqs) == 2
    assert all(q.weights == [1.0, 1.0] and q.is_weights == [0.0, 0.0] for q in got.seqs)
    assert got.metrics["mismatch/correction_zeroed_tokens"] == 0
    assert all(q.rejected == 0 for q in got.seqs)
    masked = objective.train_sequences(
        [_group()], C.load("demo", ["mismatch.correction=mask", "mismatch.level=sequence"]), 4,
        far)
    assert masked.seqs == [] and masked.metrics["mismatch/correction_zeroed_tokens"] == 4


def test_asynchronous_runs_use_the_correction_in_place_of_the_behaviour_cap():
    base = ["async.enabled=true", "async.prox_logp=recompute"]
    plain = _objective(*base)
    assert plain.decoupled.cap_mode == "mask" and all(q.is_weights is None for q in plain.seqs)
    assert [q.old_logprobs for q in plain.seqs] == [[-0.5, -2.5]] * 2   # pi_prox, recomputed
    assert [q.behave_logprobs for q in plain.seqs] == [[-1.0, -2.0]] * 2
    fixed = _objective(*base, "mismatch.correction=truncate", "mismatch.upper=1.5")
    assert fixed.decoupled.cap_mode == "none"
    assert fixed.seqs[0].is_weights == pytest.approx([1.5, E(-0.5)])
    masked = _objective(*base, "mismatch.correction=band", "mismatch.upper=1.2",
                        "mismatch.lower=0.9")
    assert masked.seqs == []    # every token outside the band: nothing of it is trained
    with pytest.raises(C.ConfigError, match="prox_logp"):
        C.load("demo", ["async.enabled=true", "async.prox_logp=loglinear",
                        "mismatch.correction=mask"])


# --- real engines: float32 agrees, bfloat16 does not ---------------------------------------------

def _engine_samples(dtype):
    from trainer.engine.embedded import EmbeddedEngine
    from trainer.models.loading import load_model, load_tokenizer

    model = load_model("builtin", torch.device("cpu"), torch.float32).eval()
    tok = load_tokenizer("builtin")
    eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=8, max_seq_len=200,
                         seed=5, dtype=dtype)
    samples = [Sample(tok(t).input_ids, SamplingParams(max_new_tokens=60))
               for t in ["[3,5]=", "[1,2,3,4,5,6,7,8,9]=", "[9]=", "[4,4,4,4]=", "[7,1,8]="] * 2]
    eng.generate(samples)
    trainer = [full_forward_logprobs(model, s).tolist() for s in samples]
    return samples, trainer


# float32 engine vs float32 trainer: the same math in another order (continuous batching, a KV
# cache); measured here: |d| at most ~1e-5
FP32_TOLERANCE = 1e-4


def test_a_float32_engine_agrees_with_the_trainer_and_bfloat16_does_not():
    for dtype, agrees in ((torch.float32, True), (torch.bfloat16, False)):
        samples, trainer = _engine_samples(dtype)
        old, mask = rc.padded(trainer)
        roll, _ = rc.padded([s.logprobs for s in samples])
        f = rc.figures(old, roll, mask, lower=0.5, upper=2.0)
        assert f["tokens"] > 100
        if agrees:
            assert f["abs_logp_diff_max"] < FP32_TOLERANCE and f["kl"] < 1e-8
        else:
            assert f["abs_logp_diff"] > 10 * FP32_TOLERANCE and f["abs_logp_diff_max"] > 1e-2
            # the correction's weights differ from 1 exactly where the log-probabilities differ
            w = rc.weights(old, roll, mask, rc.Correction("truncate", "token", 0.5, 2.0))
            on = mask > 0
            differs = (old != roll) & on
            assert torch.equal((w != 1) & on, differs)
            assert int(differs.sum()) > 0.5 * int(on.sum())   # guard: bf16 moved most tokens


def test_a_bfloat16_engine_run_reports_the_mismatch_and_trains_with_each_correction(tmp_path):
    from trainer.observe.metrics import MemorySink
    from trainer.run.runner import Runner

    seen = {}
    for mode in ("off", "truncate", "mask", "band"):
        cfg = C.load("demo", TINY_RUN + ["rollout.dtype=bfloat16", "run.max_steps=3",
                                         f"mismatch.correction={mode}"])
        sink = MemorySink()
        with Runner(cfg, tmp_path / mode, sink=sink, system_telemetry=False) as r:
            r.run()
        # measured over the step's trained tokens: a step with none (every group zero-variance)
        # has no figure
        rows = [row for row in sink.steps if row.get("actor/loss_tokens")]
        assert rows, "no step trained: the run proves nothing"
        assert all(row["mismatch/abs_logp_diff"] > 10 * FP32_TOLERANCE for row in rows)
        assert any(h["name"] == "mismatch/seq_log_ratio" for h in sink.histograms)
        seen[mode] = rows
        if mode != "off":
            assert all("mismatch/correction_weight" in row for row in rows)
    assert "mismatch/correction_weight" not in seen["off"][0]


def test_the_correction_knobs_change_mid_run_at_a_step_boundary_and_are_recorded(tmp_path):
    from trainer.observe.metrics import MemorySink
    from trainer.run.controls import SET_KNOBS, Command, ControlSource
    from trainer.run.runner import Runner

    change = {"mismatch.correction": "mask", "mismatch.level": "sequence",
              "mismatch.lower": 0.25, "mismatch.upper": 4.0}

    class AfterTwoSteps(ControlSource):
        def __init__(self):
            self.sent = False

        def poll(self):
            if self.sent or len(sink.steps) < 2:
                return []
            self.sent = True
            return [Command(SET_KNOBS, knobs=change, requested_by="test")]

    sink = MemorySink()
    cfg = C.load("demo", TINY_RUN + ["rollout.dtype=bfloat16", "run.max_steps=5"])
    with Runner(cfg, tmp_path, sink=sink, controls=AfterTwoSteps(),
                system_telemetry=False) as r:
        r.run()
        assert {k: r.cfg.get(k) for k in change} == change
    applied = [e for e in sink.events if e["kind"] == "knob_applied"]
    assert len(applied) == 1 and applied[0]["step"] == 2   # at the boundary after step 2
    assert {k: v["new"] if isinstance(v, dict) else v
            for k, v in applied[0]["changes"].items()} == change, applied[0]
    before = [row for row in sink.steps if row["step"] <= 2]
    after = [row for row in sink.steps if row["step"] >= 3 and row.get("actor/loss_tokens")]
    assert before and after, "no step trained after the change: the test proves nothing"
    assert not any("mismatch/correction_weight" in row for row in before)
    assert all("mismatch/correction_weight" in row for row in after)


def test_icepop_is_mask_at_token_level_and_band_is_rejection_without_reweighting():
    """IcePop keeps the ratio inside [alpha, beta] and zeroes it outside: `mask`. `band` keeps
    weight 1 inside: plain rejection. The behaviour by hand, and the names a person reads (the
    config help, the module's docstring, algorithms.md) say so: they called `band` IcePop."""
    old, roll = torch.tensor([[0.0, 0.2, -2.0]]), torch.tensor([[0.0, 0.0, 0.0]])
    mask = torch.ones(1, 3)
    ice = rc.weights(old, roll, mask, rc.Correction("mask", "token", 0.5, 2.0))
    assert ice.tolist()[0] == pytest.approx([1.0, E(0.2), 0.0])   # e^-2 < 0.5: zeroed
    band = rc.weights(old, roll, mask, rc.Correction("band", "token", 0.5, 2.0))
    assert band.tolist()[0] == [1.0, 1.0, 0.0]
    assert rc.rejected(old, roll, mask, rc.Correction("band", "token", 0.5, 2.0)).tolist() == \
        [[False, False, True]]
    help_text = C.param_spec("mismatch.correction").help
    for text in (help_text, rc.__doc__, open("docs/algorithms.md").read()):
        assert "band = IcePop" not in text and "`band` (IcePop)" not in text
        assert "(IcePop: drop, never reweight)" not in text
    assert "IcePop at level token" in help_text
