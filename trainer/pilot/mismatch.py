"""The training–inference mismatch: how far the engine's log-probabilities (pi_rollout) are from
the trainer's (pi_old), measured each step as mismatch/* (trainer/algo/rollout_correction.py).
High or rising while nothing corrects it: turn the rollout correction on (TIS). Still high with
the correction on, or the correction dropping many tokens: the gap itself is too large --
raise the engine's precision (`rollout.dtype`, fixed at launch: a fork), or correct per sequence.

Which figure: the k3 KL(pi_rollout || pi_old) token mean, by its median over the window (one
step's long rare-token tail moves a mean, not a median), at age 0 where the run splits it by
age (APRIL, asynchronous: older tokens add the policy's drift since they were sampled, which is
eta's and over-sampling's business, staleness.py and april.py); the share of tokens outside
[mismatch.lower, mismatch.upper] only where there is no such split (it has none by age).
Runs that do not measure (`mismatch.measure` off, runs before it existed) get no advice."""
from __future__ import annotations

import statistics

from trainer.pilot.advice import Advice, Figure, derived, figure, knob_advice, note_advice
from trainer.pilot.thresholds import Thresholds
from trainer.pilot.window import Window, kl_rising, median_halves

KNOB = "mismatch.correction"
KL, AGE0_KL = "mismatch/kl", "mismatch/age0/kl"
OUTSIDE = "mismatch/outside_band_ratio"
ZEROED = "mismatch/correction_zeroed_ratio"
WEIGHT = "mismatch/correction_weight"     # reported at the steps the correction was on
LOWER_PRECISION = ("bfloat16", "float16")


def kl_name(w: Window) -> str:
    """The engine's own mismatch: its age-0 figure where the run reports one, else all tokens'."""
    return AGE0_KL if w.has(AGE0_KL) else KL


def mismatch_figures(w: Window, th: Thresholds) -> tuple[str, str, list[Figure]] | None:
    """(reason, why in words, evidence) when the mismatch is high or rising over the window:
    the median KL at least mismatch_kl_high, or the share of tokens outside the band at least
    mismatch_outside_high, or the KL's median doubling (kl_rise_factor) from one half of the
    window to the next while at least mismatch_kl_rise_min (window.kl_rising, the KL rule's test).
    None otherwise, and over fewer than min_steps measured steps."""
    name = kl_name(w)
    values = [v for _, v in w.series(name)]
    if len(values) < th.min_steps:
        return None
    median = statistics.median(values)
    outside = figure(w, OUTSIDE) if name == KL else None
    rise = kl_rising(values, th.kl_rise_factor, th.mismatch_kl_rise_min)
    # the largest |d log p| has no age split: with one, age 0's mean |d log p| instead
    spread = figure(w, "mismatch/abs_logp_diff_max") if name == KL else \
        figure(w, "mismatch/age0/abs_logp_diff")
    evidence = [derived(name, "median", median, w, name), figure(w, name, "last"), spread]
    if median >= th.mismatch_kl_high:
        reason, why = "mismatch_high", (f"the engine's log-probabilities are far from the trainer's: "
                                        f"median KL(pi_rollout || pi_old) {median:.3g} over the "
                                        f"window (limit {th.mismatch_kl_high:g})")
    elif outside is not None and outside.value >= th.mismatch_outside_high:
        reason, why = "mismatch_high", (f"{outside.value:.1%} of the tokens have pi_old / "
                                        f"pi_rollout outside the band (limit "
                                        f"{th.mismatch_outside_high:.0%}; median KL {median:.3g})")
    elif rise is not None:
        reason, why = "mismatch_rising", (f"the engine-trainer KL is rising: median {rise[0]:.3g} "
                                          f"-> {rise[1]:.3g} over the window")
    else:
        return None
    if outside is not None:
        evidence.append(outside)
    if rise is not None:
        halves = median_halves(values)
        evidence += [derived(name, "median, first half", halves[0], w, name),
                     derived(name, "median, second half", halves[1], w, name)]
    return reason, why, [f for f in evidence if f is not None]


def corrected_by(cfg) -> str | None:
    """What corrects the loss by pi_old / pi_rollout now (None: nothing). Asynchronous runs with
    pi_prox recomputed weight every token by pi_prox / pi_b already (the decoupled loss's
    behaviour weight, capped at async.behave_imp_cap): for a fresh token that is this ratio."""
    if cfg.mismatch.correction != "off":
        return f"mismatch.correction = {cfg.mismatch.correction} at {cfg.mismatch.level} level"
    if cfg.async_.enabled and cfg.async_.prox_logp == "recompute":
        return "the decoupled loss's behaviour weight pi_prox / pi_b"
    return None


def mismatch_uncorrected(w: Window, cfg, th: Thresholds) -> Advice | None:
    """High or rising while nothing corrects it: turn the correction on (truncate: TIS, the
    weight min(pi_old / pi_rollout, upper)). Asynchronous runs that interpolate pi_prox cannot
    (checks.py refuses a correction without the trainer's pi_prox): a fork, not a knob."""
    if corrected_by(cfg) is not None:
        return None
    found = mismatch_figures(w, th)
    if found is None:
        return None
    reason, why, evidence = found
    upper = cfg.mismatch.upper
    if cfg.async_.enabled:   # prox_logp = loglinear: pi_prox comes from the engine's own numbers
        return note_advice(
            "mismatch", reason,
            message=f"{why}, and nothing corrects it; the correction needs the trainer's pi_prox "
            "(async.prox_logp = recompute), which is fixed at launch: fork the run from its latest "
            "checkpoint with --set async.prox_logp=recompute --set mismatch.correction=truncate",
            expected="each token's loss weighted by pi_old / pi_rollout (capped): the bias the gap "
            "puts into the gradient is corrected", confidence="medium", evidence=evidence)
    return knob_advice(
        "mismatch", reason, cfg, KNOB, "truncate",
        message=f"turn the rollout correction on (truncate: TIS, each token's weight "
        f"min(pi_old / pi_rollout, {upper:g}) at {cfg.mismatch.level} level): {why}",
        expected="the loss weighted by pi_old / pi_rollout: the gradient's bias from the gap is "
        "corrected (mismatch/correction_weight near 1, a few truncated tokens); the gap itself "
        "stays: mismatch/kl does not fall", confidence="medium", evidence=evidence)


def mismatch_despite_correction(w: Window, cfg, th: Thresholds) -> Advice | None:
    """Still high or rising over the steps the correction was on, or the correction drops at
    least mismatch_zeroed_high of the tokens: a correction cannot close the gap, the engine's
    precision can. `rollout.dtype` is fixed at launch, so the advice is a fork (not a knob)."""
    by = corrected_by(cfg)
    if by is None:
        return None
    if cfg.mismatch.correction != "off":   # only the steps it was on: "still" high
        w = Window([r for r in w.rows if r.get(WEIGHT) is not None])
    found = mismatch_figures(w, th)
    zeroed = figure(w, ZEROED) if len(w.series(ZEROED)) >= th.min_steps else None
    if zeroed is not None and zeroed.value >= th.mismatch_zeroed_high:
        reason = "correction_drops_tokens"
        why = (f"{by} drops {zeroed.value:.1%} of the tokens from the loss (limit "
               f"{th.mismatch_zeroed_high:.0%})")
        evidence = [zeroed] + (found[2] if found else [])
    elif found is not None:
        reason, why, evidence = found[0], f"{found[1]}, with {by} on", found[2]
        if zeroed is not None:
            evidence.append(zeroed)
    else:
        return None
    engine, trainer = cfg.rollout.dtype, cfg.model.dtype
    instead = _sequence_level(cfg)
    if engine in LOWER_PRECISION and trainer != engine:
        return note_advice(
            "mismatch", reason,
            message=f"{why}: raise the engine's precision from {engine} to float32 "
            f"(rollout.dtype; the trainer's model.dtype = {trainer}); it is fixed at launch: fork "
            "the run from its latest checkpoint with --set rollout.dtype=float32 (SGLang: servers "
            "relaunched with --dtype float32)" + (f"; without a fork, {instead}" if instead else ""),
            expected="mismatch/kl falls toward the trainer's own rounding (a float32 engine "
            "against the float32 trainer measured about 1e-9 on CPU, a bfloat16 one about 5e-5); "
            "fewer tokens corrected or dropped",
            confidence="medium", evidence=evidence)
    side = "in float32" if engine == "float32" else "at the trainer's precision"
    return note_advice(
        "mismatch", reason,
        message=f"{why}, though the engine runs {side} (rollout.dtype = {engine}, model.dtype = "
        f"{trainer}): the gap comes from the two sides' kernels or from the trainer's own "
        "precision; float32 on both sides (model.dtype and rollout.dtype, fixed at launch: a fork)"
        + (f", or {instead}" if instead else ""),
        expected="a smaller mismatch/kl, or a correction that drops the worst sequences whole",
        confidence="low", evidence=evidence)


def _sequence_level(cfg) -> str:
    """The algorithm-level alternative, unless the run uses it already."""
    if (cfg.mismatch.level, cfg.mismatch.correction) == ("geometric", "mask"):
        return ""
    return ("a sequence-level correction (mismatch.level = geometric, mismatch.correction = mask: "
            "Geo-MIS) drops the sequences that disagree most, whole, instead of reweighting tokens")


RULES = (mismatch_uncorrected, mismatch_despite_correction)
