"""Ways of producing a training step's groups, one module each, behind one interface
(`base.Driver`):

- `synchronous.py`: the synchronous step, with DAPO dynamic sampling;
- `april.py`: APRIL active partial rollouts (the synchronous driver's step while enabled);
- `dynamic.py`: DAPO dynamic sampling's filter and round sizing;
- `ledger.py`: where every generated token went (trained, waiting, dropped by reason);
- `selection.py`: which prompts are rolled out (the data cursor and GRESO's pre-filter);
- `greso.py`: GRESO's rule (reward traces, the skip decision, adaptive exploration);
- `asynchronous/`: AReaL asynchronous rollout with a staleness bound, one module per job (the
  admission rule, the shared state, the generation worker, collect, the driver);
  `auto_staleness.py`: the behaviour-weight verdict that tunes the bound (the pilot reads it too);
- `scoring.py`: rewards for complete groups, shaped and counted.

`build_driver` picks the driver a config asks for.
"""
from __future__ import annotations

from trainer.rollout.base import Driver, Group, PromptSource, RolloutResult, StepCounts, new_group

__all__ = ["Driver", "Group", "PromptSource", "RolloutResult", "StepCounts", "new_group",
           "build_driver"]


def build_driver(cfg, engine, tokenizer, selector, scorer, lock) -> Driver:
    # imported here: the driver modules import this package (base, april), so importing them
    # while it initialises would be circular
    if cfg.async_.enabled:
        from trainer.rollout.asynchronous import AsyncDriver

        return AsyncDriver(engine, tokenizer, selector, scorer, lock=lock,
                           batch=cfg.rollout.rollout_batch_size)
    from trainer.rollout.synchronous import SynchronousDriver

    return SynchronousDriver(engine, tokenizer, selector, scorer)
