"""Alerts a person can trust: a healthy run of every shipped preset raises none over 400 steps,
and each series rule still fires on a series built to trigger it. Hand-made series fed straight
to the sink's Monitor (pure logic, no database)."""
from __future__ import annotations

import math
import random

import pytest

from trainer import config as config_mod
from webapp.dashboard.actions import Record
from webapp.dashboard.worker.alerts import Monitor

STEPS = 400


def kl_level(shape: str, step: int, final: float = 0.2) -> float:
    """A learning policy's KL to the reference: it rises, by one of three shapes."""
    x = step / STEPS
    return final * {"linear": x, "sqrt": math.sqrt(x), "saturating": 1 - math.exp(-step / 30)}[shape]


def healthy_rows(preset: str, shape: str, seed: int = 0, late_start: bool = False) -> list[dict]:
    """What a healthy run of `preset` reports to the rules: accuracy rising 0.3 -> 0.8 (from 0
    after 20 all-wrong steps with late_start: a model learning the answer format), the share of
    all-wrong groups drawn from it per group of the preset's batch, KL rising by `shape` with
    log-normal noise of sd 0.3 (a 256-sample batch; more than a 4x4 CLI run shows on average,
    with its one-step spikes as large), staleness up to eta, a finite loss, and the training–
    inference mismatch of a bf16 engine against the fp32 trainer (mismatch/kl ~5e-5, log-normal
    sd 0.5, as the built-in model measures with rollout.dtype = bfloat16; a token outside the
    band now and then; asynchronous and APRIL presets by token age too, their mismatch/kl with
    the policy's drift of stale tokens in it, often past the KL maximum)."""
    cfg = config_mod.load(preset)
    rnd = random.Random(seed)
    mrnd = random.Random(1000 + seed)   # its own draws: the other series stay as they were
    krnd = random.Random(2000 + seed)   # KL's own too: the preset's batch shape does not reshuffle it
    n, groups = cfg.rollout.n_samples_per_prompt, cfg.rollout.rollout_batch_size
    rows = []
    for s in range(1, STEPS + 1):
        acc = 0.3 + 0.5 * s / STEPS
        if late_start:
            acc = 0.0 if s <= 20 else 0.05 + 0.6 * (s - 20) / STEPS
        p_wrong = (1 - acc) ** n
        all_wrong = sum(rnd.random() < p_wrong for _ in range(groups)) / groups
        row = {"reward/accuracy": acc, "rollout/zero_var_ratio/all_wrong": all_wrong,
               "actor/pg_loss": rnd.gauss(0, 0.05), "reward/mean": acc}
        if cfg.algo.track_kl:
            row["actor/kl"] = kl_level(shape, s) * math.exp(krnd.gauss(0, 0.3) - 0.045)
        if cfg.mismatch.measure:   # a bf16 engine against the fp32 trainer (rollout.dtype = bfloat16)
            engine = 5e-5 * math.exp(mrnd.gauss(0, 0.5))
            row.update({"mismatch/kl": engine, "mismatch/outside_band_ratio": mrnd.choice([0.0] * 9 + [0.002])})
            if cfg.async_.enabled or cfg.april.enabled:
                # by token age: stale tokens add the policy's drift since they were sampled, which
                # mismatch/kl averages in (a healthy tiny async run measured up to 0.012)
                drift = 0.01 * math.exp(mrnd.gauss(0, 1.0))
                row.update({"mismatch/age0/kl": engine, "mismatch/age1/kl": drift,
                            "mismatch/kl": (engine + drift) / 2})
        if cfg.async_.enabled:
            eta = cfg.async_.max_staleness
            row.update({"async/max_staleness": eta, "async/staleness/max": rnd.randint(0, eta),
                        "async/staleness/mean": eta / 2})
        rows.append(row)
    return rows


def alerts(rows: list[dict], start: int = 1) -> list[tuple[int, str, str]]:
    m = Monitor()
    out = []
    for s, row in enumerate(rows, start):
        out += [(r.step, r.name, r.values["rule"]) for r in m.check([Record("points", s, "", row)])]
    return out


@pytest.mark.parametrize("shape", ["linear", "sqrt", "saturating"])
@pytest.mark.parametrize("preset", config_mod.preset_names())
def test_a_healthy_run_of_every_preset_raises_no_alert(preset, shape):
    for seed in range(3):
        rows = healthy_rows(preset, shape, seed)
        assert alerts(rows) == [], (preset, shape, seed)
    assert alerts(healthy_rows(preset, shape, late_start=True)) == []


def test_the_healthy_series_exercise_every_series_rule():
    """The healthy series carry what each rule reads, with the KL where the old 5-step slope
    rule fired: the zero above is no absence of data."""
    rows = healthy_rows("all", "saturating")
    for key in ("actor/kl", "async/staleness/max", "rollout/zero_var_ratio/all_wrong", "actor/pg_loss",
                "mismatch/kl", "mismatch/outside_band_ratio"):
        assert all(key in r for r in rows)
    kl = [r["actor/kl"] for r in rows]
    slopes = [(kl[i + 5] - kl[i]) / 5 for i in range(len(kl) - 5)]
    assert sum(1 for x in slopes if x > 0.01) > 20   # what raised kl_rising before


def with_fault(preset: str, key: str, values) -> list[dict]:
    """A healthy series whose `key` follows `values(step)` from step 201 on."""
    rows = healthy_rows(preset, "sqrt")
    for s, row in enumerate(rows, 1):
        if s > 200:
            row[key] = values(s)
    return rows


@pytest.mark.parametrize("rule,preset,key,values", [
    ("staleness", "async", "async/staleness/max", lambda s: 3),
    ("kl_high", "demo", "actor/kl", lambda s: 0.6),
    ("kl_rising", "demo", "actor/kl", lambda s: min(0.45, 0.15 * 2 ** ((s - 200) / 10))),
    ("reward_collapse", "demo", "rollout/zero_var_ratio/all_wrong", lambda s: 1.0),
    ("nan_loss", "april", "actor/pg_loss", lambda s: "nan"),
    ("mismatch_high", "demo", "mismatch/kl", lambda s: 0.05),
    ("mismatch_high", "async", "mismatch/age0/kl", lambda s: 0.05),
    ("mismatch_high", "demo", "mismatch/outside_band_ratio", lambda s: 0.1),
])
def test_each_rule_fires_on_a_series_built_to_trigger_it(rule, preset, key, values):
    got = alerts(with_fault(preset, key, values))
    raised = [g for g in got if g[1] == "alert"]
    assert raised and raised[0][2] == rule and 200 < raised[0][0] <= 240, got
    # nothing else but the other KL rule (a jump to 0.6 is a rise as well)
    assert {g[2] for g in raised} <= {rule} | ({"kl_rising"} if rule == "kl_high" else set()), got


def test_a_run_that_never_had_signal_is_not_collapsing_until_it_has():
    rows = [{"rollout/zero_var_ratio/all_wrong": 1.0} for _ in range(30)]
    assert alerts(rows) == []
    rows += [{"rollout/zero_var_ratio/all_wrong": 0.5}] + [{"rollout/zero_var_ratio/all_wrong": 1.0}] * 5
    assert alerts(rows) == [(36, "alert", "reward_collapse")]
