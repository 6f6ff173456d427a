"""The RNG state of a pool: its members' sampling generators as one for checkpoints."""
from __future__ import annotations

import torch

from trainer.engine.pool_members import FAILURES, LOST, Member, derived_seed


class PoolGenerator:
    """The members' sampling RNGs as one torch.Generator-like object for checkpoints: the
    state is the members' states end to end. A state saved by k engines goes to the first k
    members (a run without a pool counts as one) and the others draw fresh streams from the seed.
    A member that fails meanwhile is lost as in any other call (its restart draws a fresh
    stream)."""

    def __init__(self, pool):   # the EnginePool (trainer/engine/pool.py) whose members these are
        self.pool = pool

    def _on(self, m: Member, method: str, *args):
        try:
            return getattr(m.engine.generator, method)(*args)
        except FAILURES as e:
            self.pool._lose(m, e)
            return LOST

    def get_state(self) -> torch.Tensor:
        pool = self.pool
        with pool._lock:
            states = []
            for m in pool.members:
                state = self._on(m, "get_state") if m.engine is not None else LOST
                if state is LOST:  # a dead member's stream is gone: the one it restarts with
                    state = _fresh_state(states, derived_seed(pool.seed, m.index, m.starts + 1))
                states.append(state)
            pool._dispatch()
            return torch.cat(states)

    def set_state(self, state: torch.Tensor) -> None:
        pool = self.pool
        with pool._lock:
            live = pool._live()
            if not live:
                return
            mine = self._on(live[0], "get_state")
            if mine is LOST:
                return
            one, n = mine.numel(), len(pool.members)
            if state.numel() % one:
                raise ValueError(f"engine RNG state of {state.numel()} bytes is not a whole number "
                                 f"of generation processes' ({one} bytes each)")
            # saved by k processes: the first min(k, n) streams go on, the others start fresh
            parts = list(state.split(one))[:n]
            parts += [None] * (n - len(parts))
            for m, part in zip(pool.members, parts):
                if m.engine is None:
                    continue
                if part is None:
                    self._on(m, "manual_seed", derived_seed(pool.seed, m.index, 0))
                else:
                    self._on(m, "set_state", part)
            pool._dispatch()

    def manual_seed(self, seed: int) -> "PoolGenerator":
        with self.pool._lock:
            for m in self.pool._live():
                self._on(m, "manual_seed", derived_seed(seed, m.index, 0))
            self.pool._dispatch()
        return self


def _fresh_state(like: list[torch.Tensor], seed: int) -> torch.Tensor:
    """A generator state for `seed`, the size of the others (a CPU generator's by default)."""
    g = torch.Generator().manual_seed(seed)
    state = g.get_state()
    if like and like[0].numel() != state.numel():   # another device's generator: same size
        state = like[0].clone()
    return state
