"""APRIL active partial rollouts: how much to over-sample, how long a segment may run, and
whether max_response_len cuts answers."""
from __future__ import annotations

from trainer.pilot.advice import Advice, derived, figure, knob_advice, note_advice
from trainer.pilot.thresholds import Thresholds
from trainer.pilot.window import Window

OVERSAMPLE = "april.over_sampling_batch_size"
SEGMENT = "april.segment_max_tokens"


def over_sampling(cfg) -> int:
    """N' in effect (0 means 2 x rollout_batch_size, as trainer/rollout/april.py reads it)."""
    return cfg.april.over_sampling_batch_size or 2 * cfg.rollout.rollout_batch_size


def segment(cfg) -> int:
    """The segment limit in effect (0 means half of max_response_len)."""
    return cfg.april.segment_max_tokens or max(1, cfg.rollout.max_response_len // 2)


def _on(w: Window, cfg, th: Thresholds) -> bool:
    return cfg.april.enabled and len(w) >= th.min_steps


def _buffer_growth(w: Window) -> int:
    """How many of the last steps in a row the buffer grew."""
    s = [v for _, v in w.series("april/buffer_size")]
    n = 0
    for prev, cur in zip(reversed(s[:-1]), reversed(s)):
        if cur <= prev:
            break
        n += 1
    return n


def too_much_over_sampling(w: Window, cfg, th: Thresholds) -> Advice | None:
    """The buffer grows step after step, or many trained tokens are off-policy, or stale groups
    are dropped: less over-sampling, or (at N' = N already) a longer segment limit."""
    if not _on(w, cfg, th):
        return None
    grew, off = _buffer_growth(w), w.mean("april/offpolicy_token_ratio")
    drops = w.mean("april/span_dropped_groups")
    batch = cfg.rollout.rollout_batch_size
    drop_share = drops / batch if drops is not None else None
    reasons, evidence = [], []
    if grew >= th.buffer_growth_steps:
        reasons.append(f"the buffer grew at each of the last {grew} steps")
        evidence.append(derived("april/buffer_size", "steps in a row it grew", grew, w, "april/buffer_size"))
        evidence.append(figure(w, "april/buffer_size", "last"))
    if off is not None and off >= th.offpolicy_high:
        reasons.append(f"{off:.0%} of trained tokens are off-policy")
        evidence.append(figure(w, "april/offpolicy_token_ratio"))
    if drop_share is not None and drop_share >= th.span_drops_high:
        reasons.append(f"{drops:.1f} groups a step are dropped as too old ({drop_share:.0%} of a batch)")
        evidence.append(figure(w, "april/span_dropped_groups"))
    if not reasons:
        return None
    n_prime = over_sampling(cfg)
    why = "; ".join(reasons)
    if n_prime > batch:
        new = max(batch, int(n_prime * th.oversample_down))
        return knob_advice("april", "too_much_over_sampling", cfg, OVERSAMPLE, new,
                           message=f"over-sample less, N' {n_prime} -> {new}: {why}",
                           expected="a steady buffer, fewer off-policy tokens and stale drops",
                           confidence="medium", evidence=evidence)
    # N' is the batch already: what spans versions is a long answer decoded over several
    # segments, one step each. A longer segment finishes it in fewer steps (measured on the april
    # preset at N' = 32: halving the segment 128 -> 64 -> 32 kept 50-80% of tokens off-policy and
    # slowed steps), at the cost of waiting longer for the longest answers.
    seg, longest = segment(cfg), cfg.rollout.max_response_len
    new = min(longest, 2 * seg)
    return knob_advice("april", "too_much_over_sampling", cfg, SEGMENT, new,
                       message=f"N' is already the batch ({batch}); lengthen the segment limit "
                       f"{seg} -> {new}: {why}",
                       expected="long answers finish in fewer segments: fewer tokens from older "
                       "policies, fewer parked groups; steps wait longer for the longest answers",
                       confidence="low", evidence=evidence)


def idle_slots(w: Window, cfg, th: Thresholds) -> Advice | None:
    """Decode slots idle while the buffer is calm: over-sample more to fill them."""
    if not _on(w, cfg, th):
        return None
    idle = w.mean("rollout/idle_slot_frac")
    if idle is None or idle < th.idle_slots_high or too_much_over_sampling(w, cfg, th) is not None:
        return None
    n_prime = over_sampling(cfg)
    new = int(n_prime * th.oversample_up)
    return knob_advice("april", "idle_decode_slots", cfg, OVERSAMPLE, new,
                       message=f"over-sample more, N' {n_prime} -> {new}: {idle:.0%} of decode "
                       "slots were idle per decode step", expected="fewer idle slots, more "
                       "generated tokens per second", confidence="medium",
                       evidence=[figure(w, "rollout/idle_slot_frac"), figure(w, "april/buffer_size", "last")])


def truncated(w: Window, cfg, th: Thresholds) -> Advice | None:
    """Answers cut at rollout.max_response_len. That limit is fixed at launch (not a tunable
    knob), so the advice is a relaunch."""
    if len(w) < th.min_steps:
        return None
    share = w.mean("rollout/truncated_ratio")
    if share is None or share < th.truncated_high:
        return None
    limit = cfg.rollout.max_response_len
    # rule "length", not "april": cut answers matter with or without APRIL
    return note_advice("length", "responses_truncated",
                       message=f"{share:.0%} of responses hit max_response_len = {limit}: "
                       f"relaunch with a longer limit (e.g. {2 * limit}); it is not a knob",
                       expected="fewer cut answers scored as wrong", confidence="medium",
                       evidence=[figure(w, "rollout/truncated_ratio"),
                                 figure(w, "rollout/response_len/p90")])


RULES = (too_much_over_sampling, idle_slots, truncated)
