"""GRESO selective rollouts: the zero-variance share against its target alpha, when the
exploration probabilities can move no further; skips that cost signal."""
from __future__ import annotations

from trainer.pilot.advice import Advice, derived, figure, knob_advice, note_advice
from trainer.pilot.thresholds import Thresholds
from trainer.pilot.window import Window


def _at(w: Window, name: str, bound: float) -> float | None:
    """Share of the steps at which `name` sat at `bound` (within 1e-9)."""
    return w.share(name, lambda v: abs(v - bound) <= 1e-9)


def target_out_of_reach(w: Window, cfg, th: Thresholds) -> Advice | None:
    """The zero-variance share stays far from alpha while p_easy and p_hard sit at a clamp for
    the whole window: GRESO cannot steer further inside its bounds.
    - above alpha with both at min_p (skipping all it may): lower min_p (skip more);
    - below alpha with both at max_p (skipping the least it may): alpha asks for more
      zero-variance groups than the data has; lower alpha to what the run measures."""
    g = cfg.greso
    if not g.enabled or len(w) < th.min_steps:
        return None
    zv = w.mean("rollout/zero_var_ratio")
    if zv is None or abs(zv - g.alpha) < th.greso_gap:
        return None
    bound = g.min_p if zv > g.alpha else g.max_p
    easy, hard = _at(w, "greso/p_easy", bound), _at(w, "greso/p_hard", bound)
    if easy != 1.0 or hard != 1.0:
        return None
    evidence = [figure(w, "rollout/zero_var_ratio"), figure(w, "greso/p_easy", "last"),
                figure(w, "greso/p_hard", "last"), figure(w, "greso/skip_rate"),
                derived("greso/p_easy", f"share of steps at {bound:g}", easy, w, "greso/p_easy")]
    if zv > g.alpha:
        if g.min_p <= 0:
            return note_advice("greso", "zero_variance_above_target_at_floor",
                               message=f"{zv:.0%} of groups have no signal (target alpha = {g.alpha:g}) "
                               "though GRESO already skips all it may: the prompts are too easy or too "
                               "hard for the model; change the data (difficulty) rather than a knob",
                               expected="more groups with signal", confidence="low", evidence=evidence)
        new = round(g.min_p / 2, 4)
        return knob_advice("greso", "zero_variance_above_target", cfg, "greso.min_p", new,
                           message=f"lower GRESO's min_p {g.min_p:g} -> {new:g}: {zv:.0%} of groups "
                           f"have no signal against a target of {g.alpha:g}, and p_easy and p_hard "
                           f"sat at min_p all window", expected="GRESO skips more zero-variance "
                           "prompts; the zero-variance share falls toward alpha", confidence="medium",
                           evidence=evidence)
    new = round(zv, 2)
    return knob_advice("greso", "zero_variance_below_target", cfg, "greso.alpha", new,
                       message=f"lower GRESO's alpha {g.alpha:g} -> {new:g}: only {zv:.0%} of groups "
                       f"have no signal, and p_easy and p_hard sat at max_p all window (alpha asks "
                       "for more than the data gives)", expected="p_easy and p_hard leave their "
                       "clamp and adapt again", confidence="low", evidence=evidence)


def wrong_skips(w: Window, cfg, th: Thresholds) -> Advice | None:
    """Most judged skips were wrong -- the skipped prompt's next group had signal -- so skipping
    costs more signal than it saves generation: keep more, a higher p_floor (the least keep
    probability of any skippable prompt)."""
    g = cfg.greso
    if not g.enabled or len(w) < th.min_steps:
        return None
    judged = w.series("greso/skips_judged")
    ratios = dict(w.series("greso/wrong_skip_ratio"))
    n = sum(v for _, v in judged)
    if n < th.min_judged_skips:
        return None
    wrong = sum(ratios.get(s, 0.0) * v for s, v in judged)   # pooled: each step by its count
    share = wrong / n
    if share < th.wrong_skips_high:
        return None
    new = min(1.0, max(0.1, 2 * g.p_floor))
    return knob_advice("greso", "wrong_skips", cfg, "greso.p_floor", new,
                       message=f"raise GRESO's p_floor {g.p_floor:g} -> {new:g}: {share:.0%} of the "
                       f"{n:.0f} skips judged in the window were wrong (the prompt's next group had "
                       "signal)", expected="fewer prompts with signal skipped: a lower wrong-skip "
                       "share, at some cost in skipped generation", confidence="medium",
                       evidence=[derived("greso/wrong_skip_ratio", "share over the judged skips", share,
                                         w, "greso/wrong_skip_ratio"),
                                 derived("greso/skips_judged", "sum", n, w, "greso/skips_judged"),
                                 figure(w, "greso/skip_rate")])


RULES = (target_out_of_reach, wrong_skips)
