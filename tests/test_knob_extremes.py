"""Any value a person can set keeps a run healthy: a real run of the `april` and `all` presets
(tiny sizes) gets random tunable knobs of rollout, APRIL, GRESO and async set to random values in
their declared ranges, bounds included, every few steps. The run never fails or stalls, trains
tokens in every step whose trained groups had signal, keeps APRIL's buffer and the asynchronous
queue within their bounds, accounts for every generated token, and stops within seconds when
asked.

Seeded: which knobs move, to what, and after which step depend on the seed and the step count
alone (never the clock), so a failure's knob schedule replays. What an asynchronous run generates
between two steps still depends on thread timing (so on the machine's load): every check holds
whatever that was. Bounded to a few minutes (marked slow, run in CI)."""
import random
import threading
import time

import pytest
from helpers import TINY_RUN

from trainer import config as C
from trainer.observe.metrics import MemorySink
from trainer.rollout.april import over_sampling
from trainer.run.controls import SET_KNOBS, STOP, Command, ControlSource
from trainer.run.runner import Runner

pytestmark = pytest.mark.slow

SECTIONS = ("rollout.", "april.", "greso.", "async.")
STEPS_BEFORE_STOP = 36
CHANGE_EVERY = 3
# a stall is no step for this long: a liveness bound (a healthy tiny step takes about a second),
# not a speed target
STALL_S = 120.0
STOP_WITHIN_S = 60.0


def tunable_keys() -> list[C.ParamSpec]:
    # the time-out only says how long a stall may last before the run fails: not a health knob
    return [s for s in C.knobs() if s.name.startswith(SECTIONS) and s.name != "async.collect_timeout_s"]


def random_value(spec: C.ParamSpec, rng: random.Random):
    """A value in the declared range: a bound 40% of the time, else spread over the range (log
    scale for wide integer ranges, where small values are the ones people use)."""
    if spec.choices:
        return rng.choice(list(spec.choices))
    if spec.type is bool:
        return rng.random() < 0.5
    lo, hi = spec.min, spec.max
    if rng.random() < 0.4:
        return rng.choice([lo, hi])
    if spec.type is int:
        if hi - lo > 64 and rng.random() < 0.7:
            return min(hi, lo + int(2 ** rng.uniform(0, 7)))
        return rng.randint(lo, hi)
    return rng.uniform(lo, hi)


class RandomKnobs(ControlSource):
    """Every CHANGE_EVERY steps, one to three random knobs; a stop when the test asks. (The
    runner also polls while an asynchronous step waits: steps, not polls, set the pace.)"""

    def __init__(self, seed: int, steps_done):
        self.rng = random.Random(seed)
        self.specs = tunable_keys()
        self.steps_done = steps_done
        self.changed_at = 0
        self.stop_requested_at: float | None = None
        self.sent: list[dict] = []

    def poll(self):
        if self.stop_requested_at is not None:
            return [Command(STOP)]
        if self.steps_done() - self.changed_at < CHANGE_EVERY:
            return []
        self.changed_at = self.steps_done()
        knobs = {s.name: random_value(s, self.rng)
                 for s in self.rng.sample(self.specs, self.rng.randint(1, 3))}
        self.sent.append(knobs)
        return [Command(SET_KNOBS, knobs=knobs, requested_by="fuzz")]

    def request_stop(self):
        self.stop_requested_at = time.monotonic()


class WatchedSink(MemorySink):
    """Keeps each step's metrics with the config it ran under and when it was written."""

    def __init__(self):
        super().__init__()
        self.runner = None
        self.watched: list[tuple[dict, C.Config, float]] = []

    def scalars(self, step, values):
        super().scalars(step, values)
        if "rollout/tokens/generated" in values:
            self.watched.append(({"step": step, **values}, self.runner.cfg.copy(), time.monotonic()))


@pytest.mark.parametrize("preset, seed", [("april", 11), ("all", 12)])
def test_random_knob_values_keep_the_run_healthy(tmp_path, preset, seed):
    cfg = C.load(preset, TINY_RUN + ["rollout.max_response_len=48", "april.segment_max_tokens=24",
                                     "data.train_size=512",
                                     f"run.max_steps={10 * STEPS_BEFORE_STOP}"])
    sink = WatchedSink()
    controls = RandomKnobs(seed, lambda: len(sink.watched))
    runner = Runner(cfg, tmp_path, sink=sink, controls=controls, system_telemetry=False,
                    log=lambda *a: None)
    sink.runner = runner
    outcome: dict = {}

    def run():
        try:
            outcome["status"] = runner.run()
        except BaseException as e:  # reported below, with the knobs that led there
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    with runner:
        thread.start()
        last_step_at = time.monotonic()
        while thread.is_alive() and len(sink.watched) < STEPS_BEFORE_STOP:
            if sink.watched:
                last_step_at = max(last_step_at, sink.watched[-1][2])
            assert time.monotonic() - last_step_at < STALL_S, (
                f"no step for {STALL_S:.0f} s after step {len(sink.watched)}; knobs sent: {controls.sent}")
            time.sleep(0.2)
        controls.request_stop()
        thread.join(STOP_WITHIN_S)
        assert not thread.is_alive(), f"the run did not stop within {STOP_WITHIN_S:.0f} s"
    assert "error" not in outcome, f"{outcome.get('error')!r}; knobs sent: {controls.sent}"
    assert outcome["status"] == "stopped"

    steps = sink.watched
    assert len(steps) >= STEPS_BEFORE_STOP
    applied = [e for e in sink.events if e["kind"] == "knob_applied"]
    assert len(applied) >= 5, "too few changes were applied to prove anything"  # guard
    values_seen = {k for e in applied for k in e["changes"]}
    assert len(values_seen) >= 8  # guard: many different knobs were moved

    # a step whose every trained group had equal rewards (e.g. temperature 0.05 makes the G
    # answers identical, or 2.0 makes them all wrong) has nothing to learn from: its advantages
    # are all 0 (actor/advantage_abs_mean) and its groups' tokens are waste, visibly so
    # (rollout/waste/zero_variance). Judged by the groups the step TRAINED, not by the ones it
    # scored (rollout/zero_var_ratio): in an asynchronous run those are other groups, and which
    # ones depends on thread timing, so judging by them made this test depend on the machine's
    # load. Every step whose trained groups had signal must train something, unless a masking
    # it reports took the tokens (APRIL's off-policy mask, the mismatch correction).
    signal = [m for m, _, _ in steps if m.get("actor/advantage_abs_mean", 0.0) > 1e-6]
    assert len(signal) >= len(steps) // 4, (  # guard: enough steps had groups with signal
        len(signal), len(steps))
    idle = [(m["step"], m.get("rollout/effective_groups"), m["actor/advantage_abs_mean"])
            for m in signal if m["rollout/tokens/trained"] == 0
            and not (m.get("april/masked_tokens") or m["rollout/waste/mismatch"])]
    assert not idle, idle
    generated = sum(m["rollout/tokens/generated"] for m, _, _ in steps)
    wasted = sum(m["rollout/waste/total"] for m, _, _ in steps)
    last = steps[-1][0]
    # every token accounted for: trained, waiting, or dropped for a reason
    assert generated == last["rollout/tokens/trained_total"] + last["rollout/tokens/waiting"] + wasted
    for m, step_cfg, _ in steps:
        if "april/buffer_size" in m and not step_cfg.async_.enabled:
            assert m["april/buffer_size"] <= over_sampling(step_cfg), (m["april/buffer_size"], step_cfg.april)
        if "async/queue_size" in m:
            # the staleness rule holds accepted - consumed <= (eta + 1) x B; eta may have been
            # higher when the queued groups were admitted
            eta_max = max(c.async_.max_staleness for _, c, _ in steps)
            bound = (eta_max + 2) * step_cfg.rollout.rollout_batch_size
            assert m["async/queue_size"] <= bound, (m["async/queue_size"], bound)
