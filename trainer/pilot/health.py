"""Training health: length hacking, entropy collapse, KL runaway. Each names the knob (KL
coefficient, clip-higher, temperature, learning rate) or a stop."""
from __future__ import annotations

from trainer.pilot.advice import Advice, Figure, derived, figure, knob_advice, note_advice
from trainer.pilot.thresholds import Thresholds
from trainer.pilot.window import Window, kl_rising, median_halves


def kl_runaway_figures(w: Window, th: Thresholds) -> list[Figure] | None:
    """The evidence of a KL runaway over the window (None: none): KL past kl_max, or its
    median doubling (kl_rise_factor) from one half of the window to the next while at least
    kl_rise_min -- the test of the dashboard's kl_rising alert (window.kl_rising)."""
    s = w.series("actor/kl")
    if len(s) < th.min_steps:
        return None
    last = figure(w, "actor/kl", "last")
    values = [v for _, v in s]
    rise = kl_rising(values, th.kl_rise_factor, th.kl_rise_min)
    if rise is None and last.value <= th.kl_max:
        return None
    halves = median_halves(values)
    return [last, derived("actor/kl", "median, first half", halves[0], w, "actor/kl"),
            derived("actor/kl", "median, second half", halves[1], w, "actor/kl")]


def kl_runaway(w: Window, cfg, th: Thresholds) -> Advice | None:
    """KL past kl_max, or doubling toward it: a KL penalty (or a larger one); past twice the
    limit already, stop and look."""
    evidence = kl_runaway_figures(w, th)
    if evidence is None:
        return None
    last, before, recent = evidence
    if last.value > 2 * th.kl_max:
        return note_advice("health", "kl_far_past_limit",
                           message=f"stop and look: KL is {last.value:.3g}, past twice the limit "
                           f"{th.kl_max:g}; resume from an earlier checkpoint with a lower learning "
                           "rate or a KL penalty", expected="no more drift from the reference",
                           confidence="medium", evidence=evidence)
    coef = cfg.algo.kl_coef
    new = th.kl_coef_start if coef == 0 else 2 * coef
    return knob_advice("health", "kl_runaway", cfg, "algo.kl_coef", new,
                       message=f"raise the KL coefficient from {coef:g} to {new:g}: KL is "
                       f"{last.value:.3g} (median {before.value:.3g} -> {recent.value:.3g} over the "
                       f"window; limit {th.kl_max:g})",
                       expected="KL levels off under the limit", confidence="medium",
                       evidence=evidence)


def length_hacking(w: Window, cfg, th: Thresholds) -> Advice | None:
    """Response length grows while reward stays flat: penalise overlong answers, else stop."""
    if len(w) < th.min_steps:
        return None
    length, reward = w.halves("rollout/response_len/mean"), w.halves("reward/mean")
    if length is None or reward is None or length[0] <= 0:
        return None
    growth, change = length[1] / length[0] - 1, reward[1] - reward[0]
    if growth < th.length_growth or abs(change) > th.reward_flat:
        return None
    # small batches swing the mean length 5-45 tokens step to step (the async preset on CPU): a
    # growth the steps' own spread explains is not a trend (it advised at step 7 of such a run)
    if length[1] - length[0] <= w.halves_noise("rollout/response_len/mean"):
        return None
    evidence = [derived("rollout/response_len/mean", "second half over first half - 1", growth, w,
                        "rollout/response_len/mean"),
                derived("reward/mean", "second half minus first half", change, w, "reward/mean")]
    msg = (f"response length grew {growth:.0%} over the window while reward changed {change:+.3f}: "
           "the policy lengthens answers without earning more")
    if not cfg.algo.overlong_penalty:
        return knob_advice("health", "length_hacking", cfg, "algo.overlong_penalty", True,
                           message=msg + "; turn on the overlong penalty (DAPO soft overlong punishment)",
                           expected="length stops growing; reward unchanged", confidence="medium",
                           evidence=evidence)
    lr = cfg.optim.lr
    return knob_advice("health", "length_hacking", cfg, "optim.lr", lr / 2,
                       message=msg + f" even with the overlong penalty on; halve the learning rate to {lr / 2:g}",
                       expected="slower drift of length", confidence="low", evidence=evidence)


def entropy_collapse(w: Window, cfg, th: Thresholds) -> Advice | None:
    """Token entropy fell to a fraction of itself and near zero: clip-higher, else a higher
    temperature."""
    if len(w) < th.min_steps:
        return None
    h = w.halves("actor/entropy")
    if h is None or h[0] <= 0:
        return None
    ratio = h[1] / h[0]
    if ratio >= th.entropy_drop or h[1] >= th.entropy_floor:
        return None
    evidence = [derived("actor/entropy", "second-half mean over first-half mean", ratio, w, "actor/entropy"),
                derived("actor/entropy", "second-half mean", h[1], w, "actor/entropy")]
    msg = f"token entropy fell to {ratio:.0%} of itself ({h[1]:.3g} nats): the policy stops exploring"
    if cfg.algo.clip_high < th.entropy_clip_high:
        return knob_advice("health", "entropy_collapse", cfg, "algo.clip_high", th.entropy_clip_high,
                           message=msg + f"; raise clip_high to {th.entropy_clip_high:g} (DAPO clip-higher)",
                           expected="entropy stops falling", confidence="medium", evidence=evidence)
    t = cfg.rollout.temperature
    return knob_advice("health", "entropy_collapse", cfg, "rollout.temperature", t + 0.2,
                       message=msg + f"; raise the sampling temperature from {t:g}",
                       expected="more varied samples, more groups with signal", confidence="low",
                       evidence=evidence)


RULES = (kl_runaway, length_hacking, entropy_collapse)
