"""eta (async.max_staleness): raise it when it starves generation and the data stays on-policy
enough, lower it when the behaviour weights drift or KL runs away or a raise cost accuracy,
and say so when eta is not what limits the run.

`behaviour_verdict` is the one reading of the behaviour importance weights: async.auto_staleness
(trainer/rollout/asynchronous/driver.py) moves eta by it, and the rules below advise by it. The verdict
is the mechanism's (trainer/rollout/auto_staleness.py); this module reads it with the pilot's
thresholds."""
from __future__ import annotations

from trainer.pilot.advice import Advice, derived, figure, knob_advice, note_advice
from trainer.pilot.health import kl_runaway_figures
from trainer.pilot.thresholds import DEFAULT, Thresholds
from trainer.pilot.window import Window, number
from trainer.rollout import auto_staleness
from trainer.rollout.auto_staleness import STABLE, TIGHTEN

KNOB = "async.max_staleness"


def behaviour_verdict(behave_imp_weight: float, capped_ratio: float,
                      th: Thresholds = DEFAULT) -> str:
    """TIGHTEN: the weights pi_prox/pi_behaviour drift from 1 or too many are capped (the data
    is too stale); STABLE: they stay near 1 (a larger eta is safe); HOLD: in between. At the
    default thresholds exactly async.auto_staleness's verdict."""
    return auto_staleness.behaviour_verdict(behave_imp_weight, capped_ratio,
                                            drift_tighten=th.drift_tighten,
                                            capped_tighten=th.capped_tighten,
                                            drift_stable=th.drift_stable)


def _active(w: Window, cfg, th: Thresholds) -> bool:
    return cfg.async_.enabled and len(w) >= th.min_steps


def _at_bound_share(w: Window) -> float | None:
    """Share of steps whose max staleness reached that step's eta."""
    pairs = [(number(r.get("async/staleness/max")), number(r.get("async/max_staleness")))
             for r in w.rows]
    pairs = [(s, e) for s, e in pairs if s is not None and e is not None]
    return sum(1 for s, e in pairs if s >= e) / len(pairs) if pairs else None


def _weights(w: Window, th: Thresholds):
    imp, capped = w.mean("actor/behave_imp_weight"), w.mean("actor/behave_capped_ratio")
    if imp is None:
        return None, None, None
    return behaviour_verdict(imp, capped or 0.0, th), figure(w, "actor/behave_imp_weight"), \
        figure(w, "actor/behave_capped_ratio")


def eta_too_loose(w: Window, cfg, th: Thresholds) -> Advice | None:
    """Behaviour weights drift from 1 / are capped, or KL heads past kl_max: lower eta by one."""
    if not _active(w, cfg, th) or cfg.async_.auto_staleness:   # auto_staleness acts on this itself
        return None
    verdict, imp, capped = _weights(w, th)
    kl = kl_runaway_figures(w, th)
    if verdict == TIGHTEN:
        reason, why = "behaviour_weights_drift", (
            f"the behaviour importance weights average {imp.value:.3f} (|w - 1| > {th.drift_tighten:g}"
            f" or more than {th.capped_tighten:.0%} capped: {capped.value if capped else 0:.1%})")
        evidence = [imp, capped]
    elif kl is not None:
        reason, why = "kl_runaway", (f"KL runs away (median {kl[1].value:.3g} -> {kl[2].value:.3g}"
                                     f" over the window, last {kl[0].value:.3g}; limit {th.kl_max:g})")
        evidence = kl
    else:
        return None
    eta = cfg.async_.max_staleness
    return knob_advice("staleness", reason, cfg, KNOB, eta - 1,
                       message=f"lower eta from {eta} to {eta - 1}: {why}",
                       expected="fresher data: behaviour weights back near 1, fewer capped tokens, "
                       "at some cost in generator idle time", confidence="high" if verdict == TIGHTEN
                       else "medium", evidence=evidence)


def eta_raise_hurt(w: Window, cfg, th: Thresholds) -> Advice | None:
    """eta was raised inside the window and accuracy fell after it: lower it back."""
    if not _active(w, cfg, th) or cfg.async_.auto_staleness:
        return None
    etas = w.series("async/max_staleness")
    raised = [(s, prev) for (s, e), (_, prev) in zip(etas[1:], etas) if e > prev]
    if not raised or cfg.async_.max_staleness <= raised[-1][1]:
        return None   # no raise in the window, or it was undone already
    at = raised[-1][0]
    acc = w.series("reward/accuracy")
    before, after = [v for s, v in acc if s < at], [v for s, v in acc if s >= at]
    if len(before) < 2 or len(after) < 2:
        return None
    b, a = sum(before) / len(before), sum(after) / len(after)
    if b - a < th.accuracy_drop:
        return None
    eta = cfg.async_.max_staleness
    ev = [derived("reward/accuracy", f"mean before the raise at step {at}", b, w, "reward/accuracy"),
          derived("reward/accuracy", f"mean from step {at}", a, w, "reward/accuracy")]
    return knob_advice("staleness", "accuracy_fell_after_raise", cfg, KNOB, eta - 1,
                       message=f"lower eta from {eta} to {eta - 1}: accuracy fell from {b:.3f} to "
                       f"{a:.3f} after eta was raised at step {at}",
                       expected="accuracy back to its level before the raise", confidence="medium",
                       evidence=ev)


def eta_starves_generation(w: Window, cfg, th: Thresholds) -> Advice | None:
    """Staleness piles at eta and admission idles the generator while the behaviour weights stay
    near 1: raise eta by one."""
    if not _active(w, cfg, th) or cfg.async_.auto_staleness:
        return None
    share, idle = _at_bound_share(w), w.mean("async/generator_idle_frac")
    verdict, imp, capped = _weights(w, th)
    if share is None or idle is None or share < th.at_bound_share or idle < th.generator_blocked \
            or verdict != STABLE:
        return None
    eta = cfg.async_.max_staleness
    return knob_advice(
        "staleness", "eta_starves_generation", cfg, KNOB, eta + 1,
        message=f"raise eta from {eta} to {eta + 1}: staleness reached eta at {share:.0%} of the steps "
        f"and the generator idled {idle:.0%} of each step, while the behaviour weights stay at "
        f"{imp.value:.3f}", expected="the generator idles less (higher generated tokens/s); behaviour "
        "weights stay near 1", confidence="medium",
        evidence=[derived("async/staleness/max", "share of steps at eta", share, w,
                          "async/staleness/max"), figure(w, "async/generator_idle_frac"), imp, capped])


def generation_is_the_limit(w: Window, cfg, th: Thresholds) -> Advice | None:
    """The trainer waits on an empty queue while staleness stays under eta: eta is not the limit."""
    if not _active(w, cfg, th):
        return None
    wait, queue, share = w.mean("async/trainer_idle_frac"), w.mean("async/queue_size"), _at_bound_share(w)
    if wait is None or queue is None or wait < th.trainer_starved or queue >= th.empty_queue \
            or (share is not None and share >= th.at_bound_share):
        return None
    return note_advice(
        "staleness", "generation_is_the_limit",
        message=f"eta is not the limit: the trainer waited {wait:.0%} of each step on a queue of "
        f"{queue:.2f} groups while staleness stayed under eta; add generation (more generation "
        "processes, cluster.gen_procs, or a faster engine) rather than raising eta",
        expected="the trainer waits less once generation keeps up", confidence="medium",
        evidence=[figure(w, "async/trainer_idle_frac"), figure(w, "async/queue_size"),
                  derived("async/staleness/max", "share of steps at eta", share or 0.0, w,
                          "async/staleness/max")])


RULES = (eta_too_loose, eta_raise_hurt, eta_starves_generation, generation_is_the_limit)
