"""async.auto_staleness's one reading of the behaviour importance weights (pi_prox / pi_behaviour).

The asynchronous driver moves eta by it (`AsyncDriver.retune`, trainer/rollout/asynchronous/driver.py),
and the pilot's eta rules advise by the same verdict: trainer/pilot/staleness.py and
trainer/pilot/thresholds.py read it from here (the advisor reads the mechanism, never the
reverse; tests/test_trainer_imports.py checks that the rollout imports no trainer.pilot).
"""
from __future__ import annotations

DRIFT_TIGHTEN = 0.05    # |mean weight - 1| above which the data is too stale: lower eta
CAPPED_TIGHTEN = 0.01   # share of capped weights above which the data is too stale
DRIFT_STABLE = 0.01     # |mean weight - 1| under which a larger eta is safe
STABLE_STEPS = 5        # steps in a row with STABLE weights before auto_staleness raises eta

TIGHTEN, STABLE, HOLD = "tighten", "stable", "hold"


def behaviour_verdict(behave_imp_weight: float, capped_ratio: float, *,
                      drift_tighten: float = DRIFT_TIGHTEN, capped_tighten: float = CAPPED_TIGHTEN,
                      drift_stable: float = DRIFT_STABLE) -> str:
    """TIGHTEN: the weights pi_prox/pi_behaviour drift from 1 or too many are capped (the data
    is too stale); STABLE: they stay near 1 (a larger eta is safe); HOLD: in between."""
    drift = abs(behave_imp_weight - 1.0)
    if drift > drift_tighten or capped_ratio > capped_tighten:
        return TIGHTEN
    return STABLE if drift < drift_stable else HOLD
