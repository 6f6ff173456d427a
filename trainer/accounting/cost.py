"""What a run costs: device-seconds per process, by phase, priced per device-hour.

Each process lane of the timeline (trainer/observe/timeline.py) holds `count` devices of one
`kind` ("gpu", or "cpu" counted in cores: its torch threads) for as long as the run is up,
whether it computes or waits; the run pays for them all that time:

    wall                         = the seconds the run's steps cover (covered_seconds)
    device_s(lane)               = wall × count(lane)
    busy_s(lane, phase)          = Σ the lane's spans of that phase × count(lane)
    idle_s(lane)                 = device_s(lane) − Σ busy_s(lane, ·)   (waiting, paused, unrecorded)
    hours(kind)                  = Σ device_s of the lanes of that kind / 3600
    price                        = Σ hours(kind) × rate(kind), the kinds with a rate only

"waiting" and "paused" spans count as idle: a device held and not used. An engine inside rank
0's process holds rank 0's devices (count 0 on its own lane); generation processes and SGLang
servers hold their own (a server: one device of the run's kind, for the whole run; its own
timeline is not recorded). Priced waste: a step's cost per generated token is that step's
device-seconds (its covered wall × every lane's count) over the tokens it generated; the
tokens the ledger dropped in that step (trainer/rollout/ledger.py) cost that much each. A
server's time is held but not recorded: it is never counted idle.

A run resumed on another layout is paid for each part with the devices its start recorded
(`with_layouts`). Priced waste scales the steps' device-seconds to add up to the run's:
asynchronous steps overlap in time. The advice's figure (`drops_per_100_steps`) is a pace: each
step once, at its last attempt, its device-seconds scaled the same way. Pure functions over
what a run writes (timeline slices, metrics rows, the `devices` of its run_started /
run_resumed events); `python -m trainer cost RUN` prints them (trainer/cli/cost.py), the report's Cost card shows them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from trainer.observe.timeline import covered_seconds, phase_seconds, rank_lane
from trainer.rollout.ledger import REASONS

KINDS = ("gpu", "cpu")
IDLE_PHASES = ("waiting", "paused")   # a device held, not used


def layout_devices(device_type: str, world_size: int, threads: int, engine_lanes: dict[str, int],
                   engine_threads: int, servers: int, engine_own_gpu: bool = True) -> dict[str, dict]:
    """{lane: {"kind", "count"[, "recorded"]}} of a run's processes: `world_size` training ranks
    with `threads` torch threads each (a GPU each on CUDA), the engine's own processes
    (`engine_lanes`, from its lane_pids) with `engine_threads` (on CUDA a GPU each, none when
    they share the trainer's: `engine_own_gpu` False), and `servers` SGLang servers (their
    time is held but not recorded: never counted idle)."""
    kind = "gpu" if device_type == "cuda" else "cpu"

    def count(cpu_threads: int, gpu: int = 1) -> int:
        return gpu if kind == "gpu" else max(int(cpu_threads), 1)

    out = {rank_lane(r): {"kind": kind, "count": count(threads)} for r in range(world_size)}
    for lane in engine_lanes:
        out[lane] = {"kind": kind, "count": count(engine_threads, int(engine_own_gpu))}
    for i in range(servers):
        out[f"server {i}"] = {"kind": kind, "count": 1, "recorded": False}
    return out


@dataclass
class LaneCost:
    lane: str
    kind: str
    count: int
    device_s: float = 0.0
    busy_s: dict[str, float] = field(default_factory=dict)   # phase -> device-seconds
    idle_s: float = 0.0
    recorded: bool = True   # False: a server whose time the run does not see (never idle)

    def as_dict(self) -> dict:
        return {"lane": self.lane, "kind": self.kind, "count": self.count, "recorded": self.recorded,
                "device_s": round(self.device_s, 3), "idle_s": round(self.idle_s, 3),
                "busy_s": {p: round(s, 3) for p, s in self.busy_s.items()}}


def with_layouts(slices: list[tuple[int, list[dict]]], starts: list[tuple[float, dict | None]]
                 ) -> list[tuple[int, list[dict], dict | None]]:
    """Each (step, spans) with the devices of the start (run_started / run_resumed: (time,
    devices)) it ran after: the latest one before its first span. None where that start did
    not record them (a run from before the account)."""
    starts = sorted(starts, key=lambda x: x[0])
    out, held = [], starts[0][1] if starts else None
    for step, spans in slices:
        t0 = min((sp["start"] for sp in spans), default=None)
        if t0 is not None:
            held = next((d for t, d in reversed(starts) if t <= t0), starts[0][1] if starts else None)
        out.append((step, spans, held))
    return out


def segments(slices: list[tuple[int, list[dict], dict]]) -> list[tuple[dict, list[list[dict]]]]:
    """Consecutive steps that ran on one layout (`slices`: (step, spans, devices)), grouped: a
    run resumed on other processes is paid for each part on its own."""
    out: list[tuple[dict, list[list[dict]]]] = []
    for _, spans, devices in slices:
        if out and out[-1][0] == devices:
            out[-1][1].append(spans)
        else:
            out.append((devices, [spans]))
    return out


def lane_costs(slices: list[tuple[int, list[dict], dict]]) -> list[LaneCost]:
    """Each device-holding lane's device-seconds over the run's steps, busy by phase and idle
    (idle clamped at 0: spans a step's bound merged may cover a little more than the wall)."""
    lanes: dict[str, LaneCost] = {}
    for devices, part in segments(slices):
        wall, phases = covered_seconds(part), phase_seconds(part)
        for name, d in devices.items():
            n = int(d["count"])
            c = lanes.setdefault(name, LaneCost(name, d["kind"], n, recorded=d.get("recorded", True)))
            c.count = max(c.count, n)
            busy = {ph: sec * n for ph, sec in phases.get(name, {}).items() if ph not in IDLE_PHASES}
            for ph, sec in busy.items():
                c.busy_s[ph] = c.busy_s.get(ph, 0.0) + sec
            c.device_s += wall * n
            if c.recorded:
                c.idle_s += max(wall * n - sum(busy.values()), 0.0)
    return list(lanes.values())


NOT_STEP_PHASES = ("evaluating", "checkpointing")   # between steps: not in a step's own time


def step_walls(slices, steps_only: bool = False) -> list[float]:
    """Each recorded step's wall seconds (its timeline's cover), in the order written; the
    slices of one step written one after the other (a run's end writes its last step's final
    checkpoint apart) are one step. `steps_only`: without evaluations and checkpoints."""
    out, last = [], None
    for x in slices:
        spans = [s for s in x[1] if s["phase"] not in NOT_STEP_PHASES] if steps_only else x[1]
        wall = covered_seconds([spans])
        if out and x[0] == last:
            out[-1] += wall
        else:
            out.append(wall)
        last = x[0]
    return out


def last_attempts(slices) -> list[tuple[int, list[dict], dict]]:
    """The (step, spans, devices) slices of each step's last attempt, in the order written: a
    resume records the steps after its checkpoint again, and the run went on from the second
    attempt (a dashboard's metric row is that attempt's: its points win). A slice of the step
    just written is that attempt's unless it trains (a run's end writes its final checkpoint
    apart; a resume that retrains the last step written trains again); slices without devices
    are left out."""
    attempts: dict[int, list] = {}
    last = None
    for x in slices:
        if x[0] != last or any(s["phase"] == "training" for s in x[1]):
            attempts[x[0]] = []   # a later attempt replaces an earlier one
        attempts[x[0]].append(x)
        last = x[0]
    chosen = {id(x) for parts in attempts.values() for x in parts}
    return [x for x in slices if id(x) in chosen and x[2]]


def step_device_seconds_by_step(slices) -> dict[int, float]:
    """{step: its device-seconds} of (step, spans, devices) slices: its last attempt's
    (`last_attempts`; an earlier attempt's drops are not in the rows priced with it), each
    step's cover × its devices, scaled so that the steps add up to what the run held over
    them (asynchronous steps overlap in time: each step's cover alone counts the overlap
    twice)."""
    kept = last_attempts(slices)
    out: dict[int, float] = {}
    for step, spans, devices in kept:
        out[step] = out.get(step, 0.0) + step_device_seconds(spans, devices)
    held = sum(covered_seconds(part) * sum(int(d["count"]) for d in devices.values())
               for devices, part in segments(kept))
    raw = sum(out.values())
    return {step: s * held / raw for step, s in out.items()} if raw else out


def new_cover(spans: list[dict], reach: float) -> tuple[float, float]:
    """(the seconds `spans`' cover (first start to last end) adds past `reach`, the new reach):
    covered_seconds counted as the spans come (asynchronous steps overlap)."""
    if not spans:
        return 0.0, reach
    start, end = min(s["start"] for s in spans), max(s["end"] for s in spans)
    return max(end - max(start, reach), 0.0), max(reach, end)


def kind_counts(devices: dict[str, dict]) -> dict[str, int]:
    """The devices held per kind, every kind present (0 where none)."""
    out = dict.fromkeys(KINDS, 0)
    for d in devices.values():
        out[d["kind"]] += int(d["count"])
    return out


def step_device_seconds(spans: list[dict], devices: dict[str, dict]) -> float:
    """One step's device-seconds: its covered wall time × every lane's devices."""
    return covered_seconds([spans]) * sum(int(d["count"]) for d in devices.values())


def _keyed(items, step_of) -> dict[tuple[int, int], object]:
    """Items by (step, occurrence): a resumed run records the steps after its checkpoint
    again, and both attempts were paid for."""
    seen: dict[int, int] = {}
    out = {}
    for item in items:
        step = step_of(item)
        seen[step] = seen.get(step, -1) + 1
        out[(step, seen[step])] = item
    return out


def priced_waste(slices: list[tuple[int, list[dict], dict]], rows: list[dict], total_s: float) -> dict[str, float]:
    """Device-seconds the ledger's drops cost, per reason: each step's dropped tokens
    (rollout/waste/<reason>) × that step's device-seconds per generated token. A step's
    device-seconds are its cover × the devices, scaled so that the steps add up to the run's
    `total_s` (asynchronous steps overlap in time); a step that generated nothing (or has no
    timeline) prices its drops at the run's mean."""
    spans_of = _keyed(slices, lambda x: x[0])
    steps = _keyed([r for r in rows if "rollout/tokens/generated" in r], lambda r: r["step"])
    raw = {key: step_device_seconds(x[1], x[2]) for key, x in spans_of.items()}
    scale = total_s / sum(raw.values()) if sum(raw.values()) else 0.0
    per_token: dict[tuple[int, int], float] = {}
    spent = generated = 0.0
    for key, r in steps.items():
        made = r.get("rollout/tokens/generated") or 0
        if key not in raw:
            continue
        spent, generated = spent + raw[key] * scale, generated + made
        if made:
            per_token[key] = raw[key] * scale / made
    mean = spent / generated if generated else 0.0
    out = dict.fromkeys(REASONS, 0.0)
    for key, r in steps.items():
        for reason in REASONS:
            out[reason] += (r.get(f"rollout/waste/{reason}") or 0) * per_token.get(key, mean)
    return out


def drops_per_100_steps(rows: list[dict], step_device_s: dict[int, float], reasons) -> float | None:
    """Device-seconds the drops for `reasons` cost per 100 steps over the steps of `rows`: each
    step's drops × its device-seconds per generated token (`step_device_seconds_by_step`),
    summed, / the steps × 100. A step recorded twice (a resume) counts once, with its last
    row. None without a step whose device-seconds are known."""
    spent, steps = 0.0, 0
    last = {r["step"]: r for r in rows if "rollout/tokens/generated" in r}
    for r in last.values():
        made, held = r.get("rollout/tokens/generated"), step_device_s.get(r["step"])
        if made is None or held is None:
            continue
        steps += 1
        if made:
            spent += sum(r.get(f"rollout/waste/{x}") or 0 for x in reasons) * held / made
    return 100 * spent / steps if steps else None


def run_rates(gpu_hour: float, cpu_core_hour: float) -> dict[str, float]:
    """A run's own rates (its `cost.gpu_hour`, `cost.cpu_core_hour`), the kinds it sets (> 0)."""
    return {k: float(v) for k, v in (("gpu", gpu_hour), ("cpu", cpu_core_hour)) if v}


def price(seconds_by_kind: dict[str, float], rates: dict[str, float]) -> float | None:
    """The money for each kind's device-seconds at `rates` (per device-hour); None when no
    kind used has a rate (hours only)."""
    priced = [k for k, s in seconds_by_kind.items() if s and rates.get(k)]
    if not priced:
        return None
    return sum(seconds_by_kind[k] / 3600 * rates[k] for k in priced)


def run_cost(slices: list[tuple[int, list[dict], dict]], rows: list[dict], rates: dict[str, float]) -> dict:
    """The whole account of a run: its lanes, hours per kind, the price (where rates are set),
    per step / trained token / 1,000 generated tokens / accuracy point gained, the idle share
    (of the time recorded), and the priced waste. `slices`: (step, spans, the devices of the
    layout it ran on) of its timeline and `rows` its metrics rows, both in the order written;
    `rates`: price per device-hour by kind."""
    lanes = lane_costs(slices)
    by_kind = {k: sum(c.device_s for c in lanes if c.kind == k) for k in KINDS}
    total_s = sum(by_kind.values())
    seen_s = sum(c.device_s for c in lanes if c.recorded)
    steps = [r for r in rows if "rollout/tokens/generated" in r]
    trained = sum(r.get("rollout/tokens/trained") or 0 for r in steps)
    generated = sum(r.get("rollout/tokens/generated") or 0 for r in steps)
    evals = [r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None]
    gained = 100 * (evals[-1] - evals[0]) if len(evals) > 1 else None
    waste_s = priced_waste(slices, rows, total_s)
    figures = {"per_step": _per(total_s, len(steps)), "per_trained_token": _per(total_s, trained),
               "per_1k_generated_tokens": _per(1000 * total_s, generated),
               "per_accuracy_point": _per(total_s, gained) if gained and gained > 0 else None}
    money = price(by_kind, rates)
    # money per device-second: one number for the run's mix of kinds (a figure's device-seconds
    # are shares of the run's, in its mix)
    scale = money / total_s if money is not None and total_s else None
    return {
        "wall_s": covered_seconds([x[1] for x in slices]), "steps": len(steps),
        "lanes": [c.as_dict() for c in lanes], "device_s": total_s,
        "device_hours": {k: v / 3600 for k, v in by_kind.items() if v},
        "idle_share": sum(c.idle_s for c in lanes) / seen_s if seen_s else 0.0,
        "accuracy_points_gained": gained, "device_s_figures": figures,
        "rates": {k: v for k, v in rates.items() if v}, "price": money,
        "price_figures": None if scale is None else {
            k: None if v is None else v * scale for k, v in figures.items()},
        "waste_device_s": waste_s,
        "waste_price": None if scale is None else {k: v * scale for k, v in waste_s.items()},
        "waste_share": sum(waste_s.values()) / total_s if total_s else 0.0,
    }


def _per(amount: float, n: float | None) -> float | None:
    return amount / n if n else None
