"""DAPO dynamic sampling (`rollout.dynamic_sampling`), top to bottom.

A group whose rewards are all equal has every advantage 0: it costs a training step's compute
and teaches nothing. Dynamic sampling leaves such groups out on completion and rolls out more
prompts until the step has N groups with signal:

1. Filter (`filtered`): a complete, scored group is dropped when its rewards are all equal.
2. Size the next round (`next_sampling_batch_size`): with `needed` groups still missing and a
   share `ratio` of the groups scored so far filtered, draw ceil(needed / (1 - ratio) * 1.25),
   clamped to [lo, hi]; a ratio of 1 gives hi (never a division by zero), at most
   `rollout.max_sampling_rounds` rounds a step (`round_size`). The first round of the next
   step is sized the same way from the whole step's ratio (`first_round_size`), so a workload
   with many zero-variance groups over-samples from the start.

The synchronous step (`synchronous.py`) sizes its rounds here; with APRIL on, filtered groups
simply free their place among the N' groups in flight (`april.py`). Pure logic: no engine, no
config object. Hand-computed tests: tests/test_dynamic.py.
"""
from __future__ import annotations

import math

_TOL = 1e-9            # a ratio this close to 1 counts as 1
_OVERSAMPLE = 1.25     # safety margin of the estimate
_MAX_FACTOR = 8        # a round draws at most 8 N prompts


def filtered(group) -> bool:
    """Dynamic sampling leaves this complete, scored group out: its rewards are all equal."""
    return group.zero_variance


def next_sampling_batch_size(needed: int, zero_var_ratio: float, lo: int, hi: int) -> int:
    """Prompts to sample next so that about `needed` of them have reward variance.

    ceil(needed / (1 - ratio) * 1.25), clamped to [lo, hi]. needed <= 0 -> 0; a ratio of 1
    (>= 1 - 1e-9: nothing had variance) -> hi; a negative or NaN ratio counts as 0.
    """
    if lo > hi:
        raise ValueError(f"lo ({lo}) must not exceed hi ({hi})")
    if needed <= 0:
        return 0
    ratio = zero_var_ratio if zero_var_ratio > 0.0 else 0.0     # NaN compares False -> 0
    if ratio >= 1.0 - _TOL:
        return hi
    estimate = math.ceil(needed / (1.0 - ratio) * _OVERSAMPLE - _TOL)
    return min(hi, max(lo, estimate))


def filtered_ratio(filtered_groups: int, scored_groups: int) -> float:
    """The share of scored groups dynamic sampling left out (0 when none was scored)."""
    return filtered_groups / scored_groups if scored_groups else 0.0


def round_size(batch: int, ready: int, filtered_groups: int, scored_groups: int) -> int:
    """A later round of a step: enough prompts for the `batch - ready` groups still missing."""
    return next_sampling_batch_size(batch - ready, filtered_ratio(filtered_groups, scored_groups),
                                    1, _MAX_FACTOR * batch)


def first_round_size(batch: int, filtered_groups: int, scored_groups: int) -> int:
    """The next step's first round, from this step's ratio: at least the batch."""
    return next_sampling_batch_size(batch, filtered_ratio(filtered_groups, scored_groups),
                                    batch, _MAX_FACTOR * batch)
