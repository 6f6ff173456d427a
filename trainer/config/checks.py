"""The rules that involve more than one parameter (`check`, run on every config loaded or
changed) and `pilot.bounds`, whose items each name another parameter. A value's own syntax is its
parser's (trainer/config/values.py): this module imports no package that acts on the config."""
from __future__ import annotations

from typing import Iterable

from trainer.config.params import ConfigError
from trainer.config.schema import Config, param_spec
from trainer.config.values import (
    parse_schedule,
    parse_target_modules,
    parse_tools,
    parse_urls,
    stop_strings,
)


def check(cfg: Config) -> None:
    """Rules that involve more than one parameter."""
    errors: dict[str, str] = {}
    if cfg.data.task in ("math", "code") and not cfg.data.path:
        errors["data.path"] = f"task={cfg.data.task!r} needs a JSONL file in data.path"
    if cfg.data.task in ("sum", "arith", "drift") and cfg.data.path:
        errors["data.path"] = f"the built-in {cfg.data.task} task reads no file; leave data.path empty"
    errors.update(_task_source_problems(cfg))
    if cfg.data.drift_step and cfg.data.task != "drift":
        errors["data.drift_step"] = (f"only the drift task shifts; data.task is {cfg.data.task!r} "
                                     "(set data.task = 'drift', or data.drift_step = 0)")
    try:
        stop_strings(cfg.rollout.stop)
    except ValueError as e:
        errors["rollout.stop"] = str(e)
    if "{prompt}" not in cfg.data.prompt_template:
        errors["data.prompt_template"] = "must contain '{prompt}'"
    if cfg.algo.overlong_buffer >= cfg.rollout.max_response_len and cfg.algo.overlong_penalty:
        errors["algo.overlong_buffer"] = (f"must be smaller than rollout.max_response_len "
                                          f"({cfg.rollout.max_response_len})")
    if cfg.greso.min_p > cfg.greso.max_p:
        errors["greso.min_p"] = f"must not exceed greso.max_p ({cfg.greso.max_p})"
    n = cfg.rollout.rollout_batch_size
    if cfg.april.over_sampling_batch_size and cfg.april.over_sampling_batch_size < n:
        errors["april.over_sampling_batch_size"] = (
            f"must be at least rollout.rollout_batch_size ({n}), or 0 for 2 x that")
    if cfg.rollout.engine == "sglang" and not cfg.rollout.sglang_urls.strip():
        errors["rollout.sglang_urls"] = ("engine='sglang' needs at least one server URL, e.g. "
                                         "'http://127.0.0.1:30000'")
    elif cfg.rollout.sglang_urls.strip():
        try:
            parse_urls(cfg.rollout.sglang_urls)
        except ValueError as e:
            errors["rollout.sglang_urls"] = str(e)
    in_process_generation = (cfg.rollout.engine == "embedded" and not cfg.cluster.gen_procs
                             and not (cfg.async_.enabled and cfg.async_.worker == "process"))
    if cfg.cluster.sharding == "fsdp" and cfg.cluster.train_procs > 1 and in_process_generation:
        errors["cluster.sharding"] = ("fsdp leaves no training rank the whole model to generate with: "
                                      "set cluster.gen_procs >= 1 or rollout.engine = 'sglang'")
    try:
        pilot_bounds(cfg.pilot.bounds)
    except ValueError as e:
        errors["pilot.bounds"] = str(e)
    if cfg.async_.staleness_schedule.strip():
        eta = param_spec("async.max_staleness")
        try:
            parse_schedule(cfg.async_.staleness_schedule, (eta.min, eta.max))
        except ValueError as e:
            errors["async.staleness_schedule"] = str(e)
        else:
            if not cfg.async_.enabled:
                errors["async.staleness_schedule"] = ("schedules eta, which only an asynchronous "
                                                      "run has: set async.enabled = true")
    if cfg.april.segment_max_tokens > cfg.rollout.max_response_len:
        errors["april.segment_max_tokens"] = (f"must not exceed rollout.max_response_len "
                                              f"({cfg.rollout.max_response_len})")
    if (cfg.mismatch.correction != "off" and cfg.async_.enabled
            and cfg.async_.prox_logp != "recompute"):
        errors["mismatch.correction"] = ("corrects by pi_prox / pi_b, which needs the trainer's "
                                         "pi_prox: set async.prox_logp = 'recompute' (loglinear "
                                         "interpolates it from the engine's own log-probabilities)")
    try:
        parse_tools(cfg.episode.tools)
    except ValueError as e:
        errors["episode.tools"] = str(e)
    if cfg.episode.feedback and not cfg.episode.multi_turn:
        errors["episode.feedback"] = ("feedback needs a turn after the answer: set "
                                      "episode.max_turns > 1")
    errors.update(_agent_problems(cfg))
    if cfg.lora.rank:
        try:
            parse_target_modules(cfg.lora.target_modules)
        except ValueError as e:
            errors["lora.target_modules"] = str(e)
    if cfg.run.target_accuracy and not cfg.run.eval_every:
        errors["run.target_accuracy"] = ("is forecast from evaluations: set run.eval_every > 0 "
                                         "(or leave the target at 0)")
    if cfg.run.stop_on_violation and not cfg.run.check_invariants:
        errors["run.stop_on_violation"] = ("stops on a broken invariant, which only a run that "
                                           "checks them sees: set run.check_invariants = true")
    mm = cfg.mismatch
    if mm.correction in ("mask", "band") and mm.lower >= mm.upper:
        errors["mismatch.upper"] = (f"the band [{mm.lower:g}, {mm.upper:g}] holds only a ratio of "
                                    f"exactly 1: nearly every token would be masked; widen it")
    if errors:
        raise ConfigError(errors)


def _agent_problems(cfg: Config) -> dict[str, str]:
    """Agents' episodes (`episode.agents`) come from the agents, not from a driver that draws
    prompts: the drivers' own techniques and a configured environment do not apply."""
    if not cfg.episode.agents:
        return {}
    errors = {}
    for key, on in (("april.enabled", cfg.april.enabled), ("async.enabled", cfg.async_.enabled),
                    ("greso.enabled", cfg.greso.enabled)):
        if on:
            errors[key] = ("episode.agents: your agents start the episodes, not a driver that "
                           "draws prompts; set it to false")
    if cfg.episode.environment.strip():
        errors["episode.environment"] = ("episode.agents: your agents are the environment; leave "
                                         "episode.environment empty")
    return errors


def _task_source_problems(cfg: Config) -> dict[str, str]:
    """A reasoning-gym task that does not exist or whose options its config refuses; task_options
    given to another task."""
    from trainer.config.reasoning_gym import PREFIX, check_task

    if not cfg.data.task.startswith(PREFIX):
        return {"data.task_options": "only a reasoning_gym:NAME task takes options"} \
            if cfg.data.task_options.strip() else {}
    try:
        check_task(cfg.data.task, cfg.data.task_options)
    except ValueError as e:
        key = "data.task" if "unknown reasoning-gym task" in str(e) else "data.task_options"
        return {key: str(e)}
    return {}


def pilot_bounds(items: Iterable[str]) -> dict[str, tuple[float, float]]:
    """`pilot.bounds` as {knob: (lo, hi)}: "async.max_staleness=1..8" -> {"async.max_staleness":
    (1, 8)}. Raises ValueError naming the item that is not a tunable number's range inside the
    knob's own."""
    out: dict[str, tuple[float, float]] = {}
    for item in items:
        key, eq, rng = item.partition("=")
        lo_text, dots, hi_text = rng.partition("..")
        key = key.strip()
        if not eq or not dots:
            raise ValueError(f"{item!r}: expected 'key=lo..hi', e.g. 'async.max_staleness=1..8'")
        try:
            spec = param_spec(key)
        except ConfigError as e:
            raise ValueError(f"{item!r}: {e.errors[key]}") from None
        if not spec.tunable or spec.type not in (int, float):
            raise ValueError(f"{item!r}: {key} is not a numeric knob")
        try:
            lo, hi = spec.coerce(lo_text.strip()), spec.coerce(hi_text.strip())
        except ConfigError:
            raise ValueError(f"{item!r}: each end must be {spec.allowed()}") from None
        if lo > hi:
            raise ValueError(f"{item!r}: the low end {lo} is above the high end {hi}")
        if key in out:
            raise ValueError(f"{key} is bounded twice")
        out[key] = (lo, hi)
    return out
