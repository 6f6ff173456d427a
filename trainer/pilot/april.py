"""APRIL active partial rollouts: how much to over-sample, how long a segment may run, and
whether max_response_len cuts answers.

The advice cites APRIL's rules of thumb as context (`rules_of_thumb`), never as a condition:
over-sample 1.5-2x the batch; start the segment limit at half of the longest response, then
adjust it from the decode slots' use. The conditions are what the window measured.
"""
from __future__ import annotations

import math

from trainer.pilot.advice import Advice, derived, figure, knob_advice, note_advice
from trainer.pilot.thresholds import Thresholds
from trainer.pilot.window import Window

# the values in effect, as the rollout reads them (0 means 2 x the batch, half of max_response_len)
from trainer.rollout.april import over_sampling
from trainer.rollout.april import segment_limit as segment

OVERSAMPLE = "april.over_sampling_batch_size"
SEGMENT = "april.segment_max_tokens"
SPAN = "april.max_version_span"
OVERSAMPLE_RULE = (1.5, 2.0)   # N' over the batch, the rule of thumb


def rule_figures(cfg, longest: float = 0, mean: float | None = None) -> dict:
    """The run's APRIL values beside the rules of thumb, computed here once for the advice and
    the run page (webapp/dashboard/reports/advice.py): N' in effect and its ratio to the batch against
    1.5-2x (`rule_batch`: that range in groups); the segment limit in effect against half of the
    `longest` response seen (`first_segment`: the rule's first value, None without a length);
    and the write-up's buffer sizing, mean length × the over-sampled samples ÷ the throughput
    gain, the gain not measured on a live run and taken as 1 (the largest buffer; None without
    a `mean` length or with nothing over-sampled)."""
    batch, n_prime = cfg.rollout.rollout_batch_size, over_sampling(cfg)
    lo, hi = OVERSAMPLE_RULE
    extra = max(0, n_prime - batch) * cfg.rollout.n_samples_per_prompt
    return {"batch": batch, "over_sampling": n_prime, "ratio": n_prime / batch, "rule": OVERSAMPLE_RULE,
            "rule_batch": (math.ceil(lo * batch), int(hi * batch)), "segment": segment(cfg),
            "longest": longest, "first_segment": half(longest) if longest else None,
            "over_sampled_samples": extra,
            "buffer_sizing": round(mean * extra) if mean is not None and extra else None}


def rules_of_thumb(w: Window, cfg) -> str:
    """The rules of thumb beside the run's values (`rule_figures`, the longest response: the
    window's largest rollout/response_len/max)."""
    f = rule_figures(cfg, longest_response(w))
    (lo, hi), (lo_n, hi_n) = f["rule"], f["rule_batch"]
    parts = [f"N' {f['over_sampling']} is {f['ratio']:.1f}x the batch (rule of thumb "
             f"{lo:g}-{hi:g}x: {lo_n}-{hi_n})"]
    if f["longest"]:
        parts.append(f"segment limit {f['segment']} against half of the longest response "
                     f"({f['longest']} tokens): {f['first_segment']} (the rule of thumb's first "
                     "value, then adjusted from the idle decode slots)")
    return "rules of thumb: " + "; ".join(parts)


def longest_response(w: Window) -> int:
    """The longest response of the window (0: none reported)."""
    return int(max((v for _, v in w.series("rollout/response_len/max")), default=0))


def half(tokens: int) -> int:
    return max(1, math.ceil(tokens / 2))


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


def _tokens(w: Window, name: str) -> int:
    return int(sum(v for _, v in w.series(name)))


def segment_limit_costs(w: Window, cfg, th: Thresholds) -> Advice | None:
    """The segment limit, with max_version_span, is the cause. At s tokens a segment and R
    rounds a step an answer gets at most s R tokens a step, so within the span only answers of
    up to reach = s R (max_version_span + 1) tokens can finish; R is the window's mean
    rollout/rounds (a step that completes N groups in its first round gives each answer one
    segment), max_sampling_rounds where not reported. Longer answers are dropped for their
    span (or, at their last chance, generated to their end unsegmented, the step waiting). The
    longest answers seen understate the need (the dropped ones never finished), so the rule
    compares reach with max_response_len. Fires when reach is shorter and the window shows the
    cost: version-span drops of at least span_waste_high of the generated tokens, or at least
    last_chance_high x N groups a step at their last chance. Advice: the segment limit at half
    of the longest response (the rule of thumb), or the span that lets max_response_len finish."""
    if not _on(w, cfg, th):
        return None
    seg, span, limit = segment(cfg), cfg.april.max_version_span, cfg.rollout.max_response_len
    rounds = w.mean("rollout/rounds") or cfg.rollout.max_sampling_rounds
    reach = int(seg * rounds * (span + 1))
    if reach >= limit:
        return None   # every answer can finish within the span: the segment limit is no cause
    generated = _tokens(w, "rollout/tokens/generated")
    dropped = _tokens(w, "rollout/waste/version_span")
    drop_share = dropped / generated if generated else 0.0
    last_chance = w.mean("april/last_chance_groups") or 0.0
    batch = cfg.rollout.rollout_batch_size
    costs, evidence = [], []
    if drop_share >= th.span_waste_high:
        costs.append(f"{dropped:,} of {generated:,} generated tokens ({drop_share:.0%}) were "
                     "dropped for their version span")
        evidence += [derived("rollout/waste/version_span", "sum", dropped, w,
                             "rollout/waste/version_span"),
                     derived("rollout/tokens/generated", "sum", generated, w,
                             "rollout/tokens/generated")]
    if last_chance >= th.last_chance_high * batch:
        costs.append(f"{last_chance:.1f} groups a step reached their last chance and were "
                     "generated to their end, unsegmented, the step waiting for them")
        evidence.append(figure(w, "april/last_chance_groups"))
    if not costs:
        return None
    longest = longest_response(w) or limit
    evidence.append(derived("rollout/response_len/max", "max", longest, w, "rollout/response_len/max"))
    new = min(limit, max(seg + 1, half(longest)))
    span_needed = math.ceil(limit / (seg * rounds)) - 1
    evidence.append(figure(w, "rollout/rounds"))
    return knob_advice(
        "april", "segment_limit_too_short", cfg, SEGMENT, new,
        message=f"the segment limit is the cause: at {SEGMENT} = {seg}, {rounds:.3g} rounds a step "
        f"and {SPAN} = {span}, only answers of up to {seg} x {rounds:.3g} x {span + 1} = {reach} "
        f"tokens can finish within the span (max_response_len = {limit}); "
        f"{'; '.join(costs)}. Raise the segment limit {seg} -> {new}, or {SPAN} {span} -> "
        f"{span_needed}. {rules_of_thumb(w, cfg)}",
        expected="long answers finish within the version span: no tokens dropped for their span, "
        "no step waiting for unsegmented answers",
        confidence="medium", evidence=evidence)


def too_much_over_sampling(w: Window, cfg, th: Thresholds) -> Advice | None:
    """The buffer grows step after step, or many trained tokens are off-policy, or stale groups
    are dropped: less over-sampling, or (at N' = N already) a longer segment limit. Silent when
    the segment limit is the cause (`segment_limit_costs`): fewer groups would not help."""
    if not _on(w, cfg, th) or segment_limit_costs(w, cfg, th) is not None:
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
                           message=f"over-sample less, N' {n_prime} -> {new}: {why}. "
                           f"{rules_of_thumb(w, cfg)}",
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
    """Decode slots idle while the buffer is calm: over-sample more to fill them (not when the
    segment limit is the cause: short segments leave slots idle between rounds)."""
    if not _on(w, cfg, th) or segment_limit_costs(w, cfg, th) is not None:
        return None
    idle = w.mean("rollout/idle_slot_frac")
    if idle is None or idle < th.idle_slots_high or too_much_over_sampling(w, cfg, th) is not None:
        return None
    n_prime = over_sampling(cfg)
    new = int(n_prime * th.oversample_up)
    return knob_advice("april", "idle_decode_slots", cfg, OVERSAMPLE, new,
                       message=f"over-sample more, N' {n_prime} -> {new}: {idle:.0%} of decode "
                       f"slots were idle per decode step. {rules_of_thumb(w, cfg)}", expected="fewer idle slots, more "
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


RULES = (segment_limit_costs, too_much_over_sampling, idle_slots, truncated)
