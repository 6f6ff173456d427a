"""What the side-by-side benchmarks share: train one variant for a fixed number of steps from
the same starting model and seed, then measure held-out accuracy on the same problems; and run
several variants interleaved (A B A B A B, `--reps` rounds, round r on seed + r) so that a
noisy machine slows every variant alike, reporting each figure's median and spread. Each
variant also says where its generated rollout tokens went (the token ledger's totals: trained,
waiting at the end, dropped by reason; `waste_breakdown`)."""
from __future__ import annotations

import statistics
import tempfile
import time

from trainer import config as config_mod
from trainer.observe.metrics import MemorySink


def add_comparison_arguments(p, *, preset: str, steps: int) -> None:
    """The options every side-by-side training benchmark takes."""
    p.add_argument("--preset", default=preset)
    p.add_argument("--steps", type=int, default=steps, help="training steps per variant")
    p.add_argument("--eval-size", type=int, default=1000,
                   help="held-out problems for the accuracy after training (0 = skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=3,
                   help="rounds; the variants run interleaved, round r on seed + r")
    p.add_argument("--curve-every", type=int, default=0,
                   help="also evaluate every N steps (--eval-size problems) for the time to "
                   "reach the baseline's final accuracy (0 = off)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="applied to every variant")


def accuracy_delta(a: dict, b: dict) -> float | None:
    """a's held-out accuracy minus b's (a fraction), when both were measured."""
    if a["heldout_accuracy"] is None or b["heldout_accuracy"] is None:
        return None
    return round(a["heldout_accuracy"] - b["heldout_accuracy"], 4)


def train_variant(name: str, preset: str, overrides: list[str], *, steps: int, eval_size: int,
                  seed: int, curve_every: int = 0, log=print, extra=None) -> dict:
    """Train `steps` steps and return the summed/averaged figures a comparison needs. With
    `curve_every`, held-out accuracy also every that many steps (and at step 0), against the
    training seconds spent so far (evaluation time left out). `extra(sink)`, when given, adds
    the bench's own figures from the run's metrics (a MemorySink)."""
    from trainer.run.runner import Runner

    curve_every = curve_every if eval_size else 0
    cfg = config_mod.load(preset, [*overrides, f"run.max_steps={steps}", f"run.seed={seed}",
                                   f"run.eval_every={curve_every}", "run.checkpoint_every=0",
                                   *([f"run.eval_size={eval_size}"] if eval_size else [])])
    sink = MemorySink()
    with tempfile.TemporaryDirectory(prefix="rlpilot-bench-") as d:
        with Runner(cfg, d, sink=sink, system_telemetry=False) as runner:
            runner.save_checkpoint = lambda: None  # benchmarks keep nothing on disk
            t0 = time.monotonic()
            runner.run()
            wall = time.monotonic() - t0
            engine = runner.engine.stats  # before the evaluation below adds its own decoding
            ledger = runner.rollout.ledger
            accuracy = runner.evaluate() if eval_size else None
    s = sink.series
    gen_s = sum(s("timing/gen_s"))
    trained = sum(s("rollout/trained_tokens"))
    out = {
        "variant": name, "steps": steps, "wall_s": round(wall, 2),
        "rollout_s": round(gen_s, 2),
        "time_per_step_s": round(wall / steps, 3),
        "samples_generated": int(sum(s("rollout/samples"))),
        "tokens_generated": int(runner.totals["gen_tokens"]),
        "trained_tokens": int(trained),
        "trained_tokens_per_rollout_s": round(trained / max(gen_s, 1e-9), 1),
        "trained_tokens_per_s": round(trained / max(wall, 1e-9), 1),
        "idle_slot_frac_mean": round(_mean(s("rollout/idle_slot_frac")), 3),
        # what a generated token cost the engine: a fuller batch pays only where a decode
        # step costs less per row as rows are added
        "rows_per_decode_step": round(engine.slot_steps_used / max(engine.decode_steps, 1), 1),
        "decode_ms_per_token": round(1e3 * engine.decode_s / max(engine.generated_tokens, 1), 4),
        "admit_ms_per_token": round(1e3 * engine.admit_s / max(engine.generated_tokens, 1), 4),
        # where admissions went: prompts and histories prefilled (a resumed sample's history
        # again, when its KV cache was not kept), and cached positions resumed samples kept
        "prefill_tokens": engine.prefill_tokens,
        "prefill_shared_tokens": engine.prefill_shared_tokens,
        "prefill_calls": engine.prefill_calls,
        "resumed_prefill_tokens": engine.resumed_prefill_tokens,
        "kv_kept_tokens": engine.kv_kept_tokens, "kv_evicted": engine.kv_evicted,
        "reward_mean": round(_mean(s("reward/mean")), 4),
        "zero_var_ratio_mean": round(_mean(s("rollout/zero_var_ratio")), 4),
        "heldout_accuracy": accuracy,
    }
    out.update(waste_breakdown(ledger))
    if extra is not None:
        out.update(extra(sink))
    if cfg.pilot.autopilot:   # what the autopilot did: [step, knob, old, new, undo?]
        out["autopilot_changes"] = [
            [e["step"], k, ch["old"], ch["new"], bool(e.get("reason", {}).get("undo_of"))]
            for e in sink.events if e["kind"] == "knob_applied" and e.get("requested_by") == "autopilot"
            for k, ch in e["changes"].items()]
    if cfg.april.enabled:  # generated but never trained: its rollout time counts against APRIL
        out["buffer_tokens_at_end"] = int(runner.rollout.buffer.tokens())
    if curve_every:
        out["accuracy_curve"] = _curve(sink)
    if cfg.async_.enabled:
        # a variant whose staleness stays 0 ran synchronously, whatever its eta says; the final
        # admission counters show whether drops narrowed its window
        stale = s("async/staleness/mean")
        out.update({"staleness_mean": round(_mean(stale), 3),
                    "staleness_max": max(s("async/staleness/max"), default=0),
                    "dropped_stale_groups": int(runner.rollout.state.dropped_stale),
                    "admission": runner.rollout.counters()})
    log(f"{name}: " + ", ".join(f"{k}={v}" for k, v in out.items() if k != "variant"))
    return out


def waste_breakdown(ledger) -> dict:
    """Where the variant's generated rollout tokens went (the token ledger's totals): trained,
    still waiting at the end, dropped by reason, and the share trained."""
    out = {"ledger_generated_tokens": ledger.generated, "ledger_trained_tokens": ledger.trained,
           "waiting_tokens_at_end": ledger.waiting,
           "trained_token_share": round(ledger.trained / max(ledger.generated, 1), 4)}
    out.update({f"waste_{reason}_tokens": n for reason, n in ledger.dropped.items()})
    return out


def _curve(sink) -> list[list[float]]:
    """[[training seconds so far, held-out accuracy], ...] from a run's eval/accuracy rows."""
    elapsed, at_step = 0.0, {0: 0.0}
    for row in sink.steps:
        if "timing/step_s" in row:
            elapsed += row["timing/step_s"]
            at_step[row["step"]] = elapsed
    return [[round(at_step.get(row["step"], elapsed), 3), row["eval/accuracy"]]
            for row in sink.steps if "eval/accuracy" in row]


def time_to_accuracy(curve: list[list[float]], target: float) -> float | None:
    """Training seconds until the curve first reaches `target` (None: never)."""
    return next((t for t, acc in curve if acc >= target), None)


def compare(variants: list[tuple[str, str, list[str]]], args, log=print, extra=None
            ) -> dict[str, dict]:
    """Run every (name, preset, overrides) `args.reps` times, interleaved, and summarise each:
    the median of every figure, its [min, max] spread, the rounds' figures. The first variant is
    the baseline: each variant's `time_to_baseline_accuracy_s` is the median over rounds of the
    training seconds until it reached that round's baseline final accuracy (with
    --curve-every), None when most rounds never did. `extra`: as train_variant's."""
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    for rep in range(max(args.reps, 1)):
        for name, preset, overrides in variants:
            runs[name].append(train_variant(
                name, preset, overrides, steps=args.steps, eval_size=args.eval_size,
                seed=args.seed + rep, curve_every=getattr(args, "curve_every", 0), log=log,
                **({"extra": extra} if extra is not None else {})))
    out = {name: summarise(rs) for name, rs in runs.items()}
    base = variants[0][0]
    if getattr(args, "curve_every", 0) and args.eval_size:
        for name in out:
            times = []
            for b, r in zip(runs[base], runs[name]):
                t = time_to_accuracy(r.get("accuracy_curve", []), b["heldout_accuracy"])
                times.append(float("inf") if t is None else t)
            m = statistics.median(times)
            out[name]["time_to_baseline_accuracy_s"] = None if m == float("inf") else round(m, 2)
    return out


def summarise(rounds: list[dict]) -> dict:
    """The median of every numeric figure over rounds, its spread, and the rounds themselves."""
    first = rounds[0]
    out: dict = {"variant": first["variant"], "reps": len(rounds), "spread": {}, "rounds": rounds}
    for key, value in first.items():
        values = [r.get(key) for r in rounds]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or None in values:
            out.setdefault(key, value)
            continue
        med = statistics.median(values)
        out[key] = round(med, 4) if isinstance(med, float) else med
        if len(set(values)) > 1:
            out["spread"][key] = [min(values), max(values)]
    return out


def _mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)
