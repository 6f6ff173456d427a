"""Every threshold the pilot's rules use, in one place: a default, what it means and where it
comes from (a paper, a measurement, or the trainer's own constant it must agree with).
docs/pilot.md lists them from here."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# async.auto_staleness's verdict on the behaviour importance weights (pi_prox / pi_behaviour):
# the mechanism's constants (trainer/rollout/auto_staleness.py), read by the pilot's eta rules
# through staleness.behaviour_verdict
from trainer.rollout.auto_staleness import CAPPED_TIGHTEN, DRIFT_STABLE, DRIFT_TIGHTEN


def threshold(default: float, *, help: str, source: str):
    return field(default=default, metadata={"help": help, "source": source})


@dataclass(frozen=True)
class Thresholds:
    window: int = threshold(20, help="steps of recent metrics a rule reads (`advise --window`)",
                            source="judgement: halves of 10 steps average out one step's noise, and 20 "
                            "steps follow a knob change within a few minutes of a CPU demo run")
    min_steps: int = threshold(5, help="a rule says nothing over fewer steps than this",
                               source="async.auto_staleness waits 5 calm steps before a raise")
    # --- eta (async.max_staleness) ---------------------------------------------------------
    at_bound_share: float = threshold(0.8, help="share of steps whose max staleness equals eta "
                                      "for 'staleness piles at the bound'",
                                      source="judgement on AReaL's bound (staleness <= eta): "
                                      "at it in most steps, the bound and not generation sets the pace")
    generator_blocked: float = threshold(0.2, help="mean async/generator_idle_frac for 'admission "
                                         "blocks generation'",
                                         source="judgement: a fifth of the step idle is throughput "
                                         "worth a knob change")
    drift_tighten: float = threshold(DRIFT_TIGHTEN, help="|mean behaviour weight - 1| above which "
                                     "eta is too loose", source="async.auto_staleness (same constant)")
    capped_tighten: float = threshold(CAPPED_TIGHTEN, help="share of capped behaviour weights "
                                      "above which eta is too loose",
                                      source="async.auto_staleness (same constant)")
    drift_stable: float = threshold(DRIFT_STABLE, help="|mean behaviour weight - 1| under which a "
                                    "larger eta is safe", source="async.auto_staleness (same constant)")
    trainer_starved: float = threshold(0.5, help="mean async/trainer_idle_frac for 'the trainer "
                                       "waits on generation'",
                                       source="judgement: the trainer idle half the step")
    empty_queue: float = threshold(1.0, help="mean async/queue_size under which the queue is "
                                   "'empty'", source="less than one complete group waiting on average")
    accuracy_drop: float = threshold(0.05, help="fall of mean reward/accuracy after an eta raise "
                                     "that undoes it", source="judgement: 5 points, above the "
                                     "noise of a 32x8 batch's accuracy (sd >= sqrt(0.25/256) = 0.031 a step)")
    # --- KL (eta and health) ---------------------------------------------------------------
    kl_max: float = threshold(0.5, help="KL (k3) to the reference that counts as a runaway",
                              source="the dashboard's kl_high alert default (RLPILOT_ALERT_KL_MAX)")
    kl_rise_factor: float = threshold(2.0, help="the KL's median over the recent half of the "
                                      "window at least this many times the earlier half's: rising",
                                      source="the dashboard's kl_rising alert (RLPILOT_ALERT_KL_RISE_FACTOR); "
                                      "a learning policy's KL rises too, but far from doubling within a "
                                      "window (38 kl_rising alerts on a healthy 400-step run before this rule)")
    kl_rise_min: float = threshold(0.25, help="a KL rise counts only from this median up",
                                   source="half of kl_max: doubling from there passes the limit "
                                   "within one more window (RLPILOT_ALERT_KL_RISE_MIN)")
    # --- APRIL ------------------------------------------------------------------------------
    idle_slots_high: float = threshold(0.3, help="mean rollout/idle_slot_frac for 'decode slots "
                                       "idle': more over-sampling",
                                       source="april.adjust_segment shortens segments above the same 0.3")
    buffer_growth_steps: int = threshold(5, help="april/buffer_size grew at each of this many last "
                                         "steps: 'the buffer piles up'",
                                         source="judgement: five rises in a row is no noise")
    offpolicy_high: float = threshold(0.3, help="mean april/offpolicy_token_ratio above which "
                                      "over-sampling is too much",
                                      source="judgement: a third of the trained tokens from older "
                                      "policies is more than APRIL's off-policy correction is meant for")
    span_drops_high: float = threshold(0.1, help="april/span_dropped_groups per step over "
                                       "rollout_batch_size above which stale drops waste too much",
                                       source="judgement: a tenth of a batch regenerated every step")
    span_waste_high: float = threshold(0.05, help="share of generated tokens dropped for their "
                                       "version span (rollout/waste/version_span) over the window "
                                       "above which the segment limit costs too much",
                                       source="judgement: half of the 10% of generation that APRIL's "
                                       "avoidable drops (version span, stale, aborted, surplus) "
                                       "may take in all")
    last_chance_high: float = threshold(0.25, help="april/last_chance_groups per step over "
                                        "rollout_batch_size above which the steps wait too often for "
                                        "answers the segment limit could not finish within the span",
                                        source="judgement: a quarter of a batch generated unsegmented, "
                                        "the step waiting for its longest answer as without APRIL")
    truncated_high: float = threshold(0.05, help="mean rollout/truncated_ratio above which the "
                                      "length limit cuts answers", source="DAPO (Yu et al. 2025) "
                                      "calls truncated samples' scores reward noise (overlong reward "
                                      "shaping); the 5%: judgement")
    oversample_up: float = threshold(1.5, help="factor on the over-sampling batch when slots idle",
                                     source="judgement: one step halfway to the next doubling")
    oversample_down: float = threshold(0.75, help="factor on the over-sampling batch when it is "
                                       "too much", source="judgement: the inverse step, rounded")
    # --- GRESO ------------------------------------------------------------------------------
    greso_gap: float = threshold(0.15, help="|mean zero-variance ratio - alpha| that counts as far "
                                 "from the target", source="judgement: GRESO (Zheng et al. 2025) "
                                 "steers p by delta_p a step; a 0.15 gap over a window is no lag")
    wrong_skips_high: float = threshold(0.5, help="share of judged GRESO skips whose prompt's next "
                                        "group had signal, pooled over the window, for 'skips cost "
                                        "signal': keep more (a higher p_floor)",
                                        source="GRESO (Zheng et al. 2025) measured zero-variance prompts "
                                        "staying zero-variance the next epoch with high probability; a skip "
                                        "that loses signal more often than not has no such basis")
    min_judged_skips: int = threshold(20, help="judged skips a window needs before the wrong-skip "
                                      "share is read", source="judgement: a share of 20 has a standard "
                                      "error of at most 0.11")
    # --- health -----------------------------------------------------------------------------
    length_growth: float = threshold(0.2, help="relative growth of the mean response length "
                                     "(second half of the window over the first) for 'length grows'",
                                     source="judgement: a fifth longer within one window")
    reward_flat: float = threshold(0.02, help="|change of mean reward| (second half over first) "
                                   "under which reward is 'flat'",
                                   source="judgement: under the noise of a 32x8 batch")
    entropy_drop: float = threshold(0.25, help="entropy's second-half mean over its first-half "
                                    "mean under which it collapses", source="DAPO (Yu et al. 2025) "
                                    "names entropy collapse, with clip-higher its remedy; the 25%: judgement")
    entropy_floor: float = threshold(0.1, help="mean token entropy (nats) that a collapse must "
                                     "reach as well", source="judgement: near-greedy sampling")
    entropy_clip_high: float = threshold(0.28, help="algo.clip_high proposed against an "
                                         "entropy collapse", source="DAPO (Yu et al. 2025) clip-higher")
    kl_coef_start: float = threshold(0.01, help="algo.kl_coef proposed against a KL runaway when it "
                                     "is 0", source="judgement: a nudge, under the 0.04 of "
                                     "DeepSeekMath's GRPO")
    # --- episodes ------------------------------------------------------------------------------
    single_turn_steps: int = threshold(5, help="steps in a row whose episodes all had one model "
                                       "turn, in a run with episode.max_turns > 1, for 'multi-turn "
                                       "fell back to single turn'",
                                       source="judgement: a multi-turn run's first steps may all "
                                       "answer at once; five in a row is a pattern (verl and TRL users "
                                       "report multi-turn set-ups that silently ran single-turn)")
    # --- engine-trainer mismatch --------------------------------------------------------------
    # Measured here (demo preset, CPU): a float32 engine against the float32 trainer, mismatch/kl
    # about 1e-9; a bfloat16 engine against it, 2.4e-5 to 9.8e-5 a step and one step at 1.8e-4
    # (median 4.7e-5 over 12 steps; |d log p| at most 0.6), no token outside [0.5, 2]. Both are
    # healthy: the KL limit sits 5x above that worst step and 20x above the median.
    mismatch_kl_high: float = threshold(1e-3, help="median mismatch/kl (k3 KL(pi_rollout || pi_old), "
                                        "token mean; its age-0 figure where reported) over the "
                                        "window above which the engine-trainer gap is high",
                                        source="judgement: the order that users of verl's and slime's "
                                        "rollout correction treat as a warning sign (a rule of thumb, "
                                        "not a published bound) for this token-mean k3, the 'vllm-kl' "
                                        "that Liu, Li et al. 2025 ('When Speed Kills Stability') "
                                        "monitor; 20x the median of a bfloat16 engine against a "
                                        "float32 trainer measured here")
    mismatch_kl_rise_min: float = threshold(5e-4, help="a rise of mismatch/kl (its median doubling, "
                                            "kl_rise_factor, from one half of the window to the next) "
                                            "counts only from this median up",
                                            source="half of mismatch_kl_high, as kl_rise_min is half "
                                            "of kl_max: doubling from there passes the limit within "
                                            "one more window")
    mismatch_outside_high: float = threshold(0.01, help="mean mismatch/outside_band_ratio (tokens "
                                             "whose pi_old / pi_rollout leaves [mismatch.lower, "
                                             "mismatch.upper]) above which the gap is high",
                                             source="judgement: one token in a hundred off by more "
                                             "than the band (2x at the defaults); 0 for a bfloat16 "
                                             "engine against a float32 trainer measured here")
    mismatch_zeroed_high: float = threshold(0.05, help="mean mismatch/correction_zeroed_ratio (tokens "
                                            "a mask or band correction drops from the loss) above "
                                            "which the correction, not the engine, is doing the work",
                                            source="judgement: a twentieth of the trained tokens "
                                            "dropped each step is a loss of signal worth a relaunch")

    @classmethod
    def describe(cls) -> list[dict]:
        """Each threshold: name, default, help, source (for the docs)."""
        return [{"name": f.name, "default": f.default, "help": f.metadata["help"],
                 "source": f.metadata["source"]} for f in dataclasses.fields(cls)]


DEFAULT = Thresholds()
