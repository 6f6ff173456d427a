"""A run's cost account on its report (trainer/accounting/cost.py over the run's rows): the
timeline's slices, the ledger's per-step figures and evaluations, the devices its latest start
recorded, priced at the deployment's rates (RLPILOT_RATE_GPU_HOUR, RLPILOT_RATE_CPU_CORE_HOUR)."""
from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.cache import cache

from trainer.accounting import cost, forecast
from trainer.rollout.ledger import REASONS
from webapp.dashboard import formatting
from webapp.dashboard.models import MetricPoint, Run, RunEvent, TimelineSlice

KEYS = ["rollout/tokens/generated", "rollout/tokens/trained", "eval/accuracy",
        *(f"rollout/waste/{r}" for r in REASONS)]


def _knob(run: Run, section: str, name: str) -> float:
    return knob_value(run.config, run.knobs, section, name)


def knob_value(config: dict | None, knobs: dict | None, section: str, name: str) -> float:
    """A float knob's value now: its latest change, else the launch config's (0 when unset)."""
    value = (knobs or {}).get(f"{section}.{name}", ((config or {}).get(section) or {}).get(name))
    return float(value or 0.0)


def rates(run: Run) -> dict[str, float]:
    return rates_of(run.config, run.knobs)


def rates_of(config: dict | None, knobs: dict | None = None) -> dict[str, float]:
    """The deployment's rates, then the run's own (its [cost] knobs as they are now: a change
    prices the whole run again)."""
    return {"gpu": settings.RLPILOT_RATE_GPU_HOUR, "cpu": settings.RLPILOT_RATE_CPU_CORE_HOUR,
            **cost.run_rates(knob_value(config, knobs, "cost", "gpu_hour"),
                             knob_value(config, knobs, "cost", "cpu_core_hour"))}


def devices(run: Run) -> dict | None:
    """What the run's processes held, from its latest run_started / run_resumed (None for a
    run recorded before the trainer reported it)."""
    for data in (RunEvent.objects.filter(run_id=run.pk, kind__in=formatting.RUN_STARTS)
                 .order_by("-seq").values_list("data", flat=True)):
        if isinstance(data, dict) and isinstance(data.get("devices"), dict):
            return data["devices"]
    return None


def account(run: Run) -> dict[str, Any] | None:
    """The run's cost account, or None when it has no timeline yet or a part of it ran from a
    start that did not record its devices (before the account)."""
    starts = [(t.timestamp(), d.get("devices") if isinstance(d, dict) and isinstance(d.get("devices"), dict)
               else None)
              for t, d in RunEvent.objects.filter(run_id=run.pk, kind__in=formatting.RUN_STARTS)
              .order_by("seq").values_list("time", "data")]
    slices = cost.with_layouts(list(TimelineSlice.objects.filter(run_id=run.pk).order_by("seq")
                                    .values_list("step", "spans")), starts)
    if not slices or any(x[2] is None for x in slices):
        return None
    rows: dict[int, dict] = {}   # one row per scalar batch (a step, or an evaluation), in order
    for seq, step, key, value in (MetricPoint.objects.filter(run_id=run.pk, key__in=KEYS)
                                  .order_by("seq").values_list("seq", "step", "key", "value")):
        rows.setdefault(seq, {"step": step})[key] = value
    return cost.run_cost(slices, list(rows.values()), rates(run))


def to_end(run: Run) -> dict[str, Any] | None:
    """Time and price to the run's max_steps from its recent pace (trainer/accounting/forecast.py),
    the steps since its last knob change when there are enough, and to its target accuracy
    (run.target_accuracy) from its evaluations' trend ("target"); None without devices or steps."""
    held = devices(run)
    # the last WINDOW steps are all the pace is read from: a long run's other slices stay unread
    slices = list(TimelineSlice.objects.filter(run_id=run.pk).order_by("-seq")
                  .values_list("step", "spans")[:forecast.WINDOW])[::-1]
    if held is None or not slices:
        return None
    changed = (RunEvent.objects.filter(run_id=run.pk, kind="knob_applied").order_by("-seq")
               .values_list("step", flat=True).first())
    since = None if changed is None else sum(1 for step, _ in slices if step > changed)
    recent = forecast.window(cost.step_walls(slices), since)
    out = forecast.with_price(forecast.time_left(recent, max(run.max_steps - run.step, 0)), held, rates(run))
    target = _knob(run, "run", "target_accuracy")
    if out is not None and target:
        evals = list(MetricPoint.objects.filter(run_id=run.pk, key="eval/accuracy").order_by("-seq")
                     .values_list("step", "value")[:forecast.TREND_EVALS])[::-1]
        trend = forecast.to_target(forecast.steps_to_target(evals, target), recent)
        out["target"] = trend and forecast.with_price_range(trend, held, rates(run))
    return out


def so_far_of(run: Run) -> dict[str, Any] | None:
    """`so_far(account(run))`, kept in the cache until the run writes another row or its rates
    change: the live page asks after every step, and a long run's account reads every slice."""
    key = f"cost-so-far:{run.pk}:{run.last_seq}:{sorted(rates(run).items())}"
    try:
        hit = cache.get(key, _MISS)
    except Exception:   # the cache down (Redis): read it, as a page without the cache would
        return so_far(account(run))
    if hit is _MISS:
        hit = so_far(account(run))
        try:
            cache.set(key, hit, timeout=SO_FAR_CACHE_S)
        except Exception:
            pass
    return hit


_MISS = object()
SO_FAR_CACHE_S = 600


def so_far(a: dict[str, Any] | None) -> dict[str, Any] | None:
    """The account's headline for the live page: device-hours by kind, the price, the idle
    share and what the dropped tokens cost."""
    if a is None:
        return None
    return {"device_hours": a["device_hours"], "price": a["price"], "idle_share": a["idle_share"],
            "waste_share": a["waste_share"], "steps": a["steps"],
            "waste_price": None if a["waste_price"] is None else sum(a["waste_price"].values()),
            "waste_device_s": sum(a["waste_device_s"].values()),
            # each reason's dropped tokens, priced where a rate is set (beside the tokens chart)
            "waste_by_reason": {r: {"device_s": v, "price": None if a["waste_price"] is None else a["waste_price"][r]}
                                for r, v in a["waste_device_s"].items() if v}}


HOURS_KEYS = {"gpu": "cost/gpu_hours", "cpu": "cost/cpu_core_hours"}   # the trainer's cost/* figures


def priced_hours(figures: dict[str, Any], rates_: dict[str, float]) -> dict[str, Any] | None:
    """{device_hours, price} from a run's latest cost/* figures ({metric: value}) at `rates_`;
    None before it reported any."""
    hours = {kind: figures[key] for kind, key in HOURS_KEYS.items() if isinstance(figures.get(key), (int, float))}
    if not hours:
        return None
    return {"device_hours": sum(hours.values()), "price": cost.price({k: 3600 * h for k, h in hours.items()}, rates_)}


def headline(run: Run) -> dict[str, Any] | None:
    """The runs list's cost of a run: its device-hours so far (the trainer's cost/* figures, kept
    in its summary as they arrive) and their price at its rates; None before any."""
    return priced_hours((run.summary or {}).get("latest") or {}, rates(run))


def view(a: dict[str, Any] | None) -> dict[str, Any] | None:
    """The account as the report's table rows: text for a person."""
    if a is None:
        return None
    money = a["price"] is not None
    figures = a["price_figures"] if money else a["device_s_figures"]
    labels = {"per_step": "per step", "per_trained_token": "per trained token",
              "per_1k_generated_tokens": "per 1,000 generated tokens",
              "per_accuracy_point": "per held-out accuracy point gained"}
    waste = a["waste_price"] if money else a["waste_device_s"]
    return {
        "money": money, "price": formatting.figure(a["price"]) if money else None,
        "hours": [{"kind": k, "text": f"{h:.4g} {k} device-hours"
                   + (f" × {a['rates'][k]:g} = {h * a['rates'][k]:.4g}" if a["rates"].get(k) else "")}
                  for k, h in a["device_hours"].items()],
        "idle": f"{a['idle_share']:.0%}", "waste_share": f"{a['waste_share']:.1%}",
        "figures": [{"key": k, "label": labels[k], "text": "—" if v is None else
                     (formatting.figure(v) if money else f"{formatting.figure(v)} device-s")}
                    for k, v in figures.items()],
        "lanes": [{"lane": x["lane"], "held": f"{x['count']} {x['kind']}",
                   "device_s": formatting.figure(x["device_s"]), "idle_s": formatting.figure(x["idle_s"]),
                   "busy": ", ".join(f"{p} {formatting.figure(v)}" for p, v in
                                     sorted(x["busy_s"].items(), key=lambda kv: -kv[1]))}
                  for x in a["lanes"]],
        "waste": [{"reason": r, "text": formatting.figure(v) + ("" if money else " device-s")}
                  for r, v in waste.items() if v],
    }
