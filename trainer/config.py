"""The one schema of rlpilot's configuration.

Every parameter is declared exactly once, below, as a dataclass field made with `param()`:
its type, default, allowed range or choices, one line of help, and whether it may change while
a run is going ("tunable", i.e. a knob). The CLI, the launch form, the live-tuning panel and the
JSON API all read this schema through `schema()`; nothing else lists parameters.

Configs are loaded from TOML (a preset shipped in `trainer/presets/` or a file) and then
overridden with dotted `section.key=value` pairs. Anything wrong -- an unknown key, a wrong
type, a value out of range -- raises `ConfigError` whose `errors` maps each dotted key to a
message that names the allowed values.

Long by design: the whole schema in one file is what the form, the API, the CLI and the docs read.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

PRESETS_PACKAGE = "trainer.presets"
# what run.report_to may name (trainer/observe/trackers/: one adapter each)
TRACKERS = ("tensorboard", "wandb", "mlflow")


class ConfigError(ValueError):
    """Invalid configuration. `errors` maps a dotted key ('optim.lr') to what is wrong."""

    def __init__(self, errors: dict[str, str]):
        self.errors = dict(errors)
        super().__init__("; ".join(f"{k}: {v}" for k, v in self.errors.items()))


def param(default, *, help: str, min=None, max=None, choices=None, tunable=False):
    """Declare one parameter. `min`/`max` are inclusive bounds. A list parameter (default a
    list) holds distinct items, each one of `choices` when given."""
    meta = {"help": help, "min": min, "max": max, "choices": tuple(choices) if choices else None,
            "tunable": tunable}
    if isinstance(default, list):   # a dataclass field cannot share one mutable default
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------

@dataclass
class ModelConfig:
    path: str = param("builtin", help="'builtin' (the small CPU model shipped with rlpilot) or a "
                      "local directory holding a Hugging Face causal LM and its tokenizer")
    device: str = param("auto", choices=["auto", "cpu", "cuda"],
                        help="where the trainer and the embedded engine run; auto = cuda if present")
    dtype: str = param("auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="parameter dtype; auto = bfloat16 on cuda, float32 on cpu")
    threads: int = param(0, min=0, max=256, help="torch CPU threads (0 = leave torch's default)")


@dataclass
class DataConfig:
    task: str = param("sum", choices=["sum", "math", "code", "arith"],
                      help="built-in list-sum task, a JSONL file of math or code problems, or "
                      "arith: built-in arithmetic and word problems scored as math (\\boxed{} answers)")
    path: str = param("", help="JSONL file for task=math ({prompt, answer}) or task=code "
                      "({prompt, tests, entry_point})")
    eval_path: str = param("", help="math/code: JSONL of held-out problems (empty = evaluate on "
                           "the first training rows)")
    train_size: int = param(4096, min=1, max=10_000_000,
                            help="sum/arith tasks: distinct training problems (drawn in shuffled epochs)")
    max_list_len: int = param(24, min=1, max=64, help="sum task: longest list")
    length_alpha: float = param(1.0, min=0.1, max=10.0,
                                help="sum task: Pareto shape of the list length (smaller = heavier tail)")
    max_operand: int = param(9, min=1, max=999, help="sum task: largest list element; arith: "
                             "largest operand")
    prompt_template: str = param("{prompt}", help="how a problem becomes a prompt; "
                                 "'{prompt}' is replaced by the problem text (inside the chat "
                                 "template's user turn when one applies)")
    chat_template: str = param("auto", choices=["auto", "none"],
                               help="auto: wrap prompts in the tokenizer's chat template (with the "
                               "assistant's generation prompt) when it has one; none: plain text")
    system_prompt: str = param("", help="a system message put before every prompt (empty = none; "
                               "a JSONL row's own system message wins)")


@dataclass
class RolloutConfig:
    engine: str = param("embedded", choices=["embedded", "sglang"],
                        help="rollout engine: the embedded torch engine, or SGLang servers over HTTP")
    sglang_urls: str = param("", help="engine=sglang: comma-separated server URLs, e.g. "
                             "'http://127.0.0.1:30000,http://127.0.0.1:30001'")
    sglang_timeout_s: float = param(300.0, min=1.0, max=86400.0,
                                    help="engine=sglang: longest wait for one HTTP call (a whole "
                                    "/generate); failures are retried, then the run fails")
    sglang_weights_dir: str = param("", help="engine=sglang: folder the new weights are written to "
                                    "for /update_weights_from_disk; must be readable by the "
                                    "servers (empty = RUN_DIR/engine_weights)")
    sglang_down_timeout_s: float = param(600.0, min=1.0, max=86400.0,
                                         help="engine=sglang: with every server out of service, "
                                         "generation waits this long for one to come back (each "
                                         "is probed with back-off and rejoins), then the run fails")
    sglang_weight_sync: str = param("distributed", choices=["distributed", "disk"],
                                    help="engine=sglang: how new weights reach the servers: "
                                    "broadcast over a torch.distributed group (NCCL or gloo, no "
                                    "file; falls back to disk when it fails) or written to "
                                    "sglang_weights_dir for /update_weights_from_disk")
    n_samples_per_prompt: int = param(8, min=1, max=256, help="responses per prompt (group size G)")
    rollout_batch_size: int = param(32, min=1, max=4096, help="groups (prompts) trained per step (N)")
    max_response_len: int = param(256, min=1, max=32768, help="most tokens in one response")
    max_slots: int = param(128, min=1, max=4096,
                           help="sequences the engine decodes at once (continuous batching)")
    temperature: float = param(1.0, min=0.05, max=2.0, tunable=True, help="sampling temperature")
    top_p: float = param(1.0, min=0.01, max=1.0, tunable=True, help="nucleus sampling threshold")
    recompute_kv_on_update: bool = param(False, help="recompute in-flight sequences' KV cache "
                                         "under new weights at a weight update")
    dynamic_sampling: bool = param(False, tunable=True, help="DAPO dynamic sampling: drop "
                                   "zero-variance groups and roll out more prompts until the step "
                                   "has rollout_batch_size effective groups")
    max_sampling_rounds: int = param(8, min=1, max=64, tunable=True,
                                     help="most generation rounds per step: dynamic sampling's "
                                     "rounds, APRIL's segments per sample")
    stop: str = param("", help="extra stop strings, as a JSON list (e.g. '[\"</answer>\"]'); a "
                      "response ends with the token that completes one, which stays in it "
                      "(the model's eos tokens always stop)")


@dataclass
class AlgoConfig:
    clip_low: float = param(0.2, min=0.0, max=1.0, tunable=True,
                            help="PPO clip range below 1 (ratio >= 1 - clip_low)")
    clip_high: float = param(0.28, min=0.0, max=10.0, tunable=True,
                             help="PPO clip range above 1 (DAPO clip-higher)")
    kl_coef: float = param(0.0, min=0.0, max=10.0, tunable=True,
                           help="weight of the k3 KL penalty to the frozen reference policy")
    track_kl: bool = param(True, help="compute KL to the reference even when kl_coef is 0 "
                           "(one extra forward pass per step)")
    scale_adv_by_std: bool = param(True, help="divide group-centred rewards by the group std (GRPO); "
                                   "false = Dr. GRPO")
    skip_zero_adv: bool = param(True, help="leave groups whose rewards are all equal out of the update")
    overlong_penalty: bool = param(False, tunable=True,
                                   help="DAPO soft penalty for responses near max_response_len")
    overlong_buffer: int = param(64, min=1, max=32768, tunable=True,
                                 help="length of the penalty ramp before max_response_len (tokens)")
    overlong_penalty_factor: float = param(1.0, min=0.0, max=10.0, tunable=True,
                                           help="largest overlong penalty")
    recompute_old_logprobs: bool = param(False, help="recompute pi_old with the trainer instead of "
                                         "using the engine's logprobs (use with bf16 engines)")


@dataclass
class OptimConfig:
    lr: float = param(1e-4, min=0.0, max=1.0, tunable=True, help="learning rate (AdamW)")
    weight_decay: float = param(0.0, min=0.0, max=1.0, help="AdamW weight decay")
    grad_clip: float = param(1.0, min=0.0, max=1000.0, tunable=True,
                             help="max global gradient norm (0 = no clipping)")
    micro_batch_tokens: int = param(8192, min=64, max=10_000_000,
                                    help="tokens per forward/backward micro-batch")
    mini_batches: int = param(1, min=1, max=64, help="optimizer updates per step (PPO mini-batches)")


@dataclass
class AprilConfig:
    enabled: bool = param(False, tunable=True, help="active partial rollouts: over-sample, stop the "
                          "step once N groups are complete, continue the rest next step")
    over_sampling_batch_size: int = param(0, min=0, max=65536, tunable=True,
                                          help="most groups held for later steps, in flight and "
                                          "buffered (N' >= N); 0 = 2 x rollout.rollout_batch_size")
    segment_max_tokens: int = param(0, min=0, max=32768, tunable=True,
                                    help="most tokens a sample generates in one round before it "
                                    "is parked as partial; 0 = half of rollout.max_response_len")
    segment_auto: bool = param(False, tunable=True, help="adjust segment_max_tokens from the "
                               "engine's idle-slot fraction")
    max_version_span: int = param(5, min=0, max=1000, tunable=True,
                                  help="a sample whose oldest token is more than this many policy "
                                  "versions old is handled by span_policy")
    span_policy: str = param("drop", choices=["drop", "keep"], tunable=True,
                             help="too-old samples: drop the group and requeue its prompt, or keep "
                             "and train them with off-policy handling")
    offpolicy: str = param("tis", choices=["as_is", "mask", "tis"], tunable=True,
                           help="tokens from older policy versions: train as they are, mask them "
                           "out, or weight by truncated importance sampling")
    tis_cap: float = param(2.0, min=1.0, max=100.0, tunable=True,
                           help="upper bound of the truncated importance weight (offpolicy=tis)")
    decay: float = param(1.0, min=0.0, max=1.0, tunable=True,
                         help="extra weight lambda^age on tokens `age` versions old (1 = off; "
                         "0.9 is a common choice)")
    admission: str = param("fifo", choices=["fifo", "short_first"], tunable=True,
                           help="order of new prompts: as drawn, or shortest historical response "
                           "length first")


@dataclass
class GresoConfig:
    enabled: bool = param(False, tunable=True, help="selective rollouts: skip prompts whose recent "
                          "groups were all-correct or all-wrong")
    alpha: float = param(0.25, min=0.0, max=1.0, tunable=True,
                         help="target zero-variance ratio the exploration probabilities steer to")
    delta_p: float = param(0.01, min=0.0, max=0.5, tunable=True,
                           help="step by which p_easy / p_hard move each training step")
    min_p: float = param(0.05, min=0.0, max=1.0, tunable=True, help="lower clamp of p_easy/p_hard")
    max_p: float = param(0.95, min=0.0, max=1.0, tunable=True, help="upper clamp of p_easy/p_hard")
    p_floor: float = param(0.01, min=0.0, max=1.0, tunable=True,
                           help="a skippable prompt is still kept with at least this probability")
    p_easy: float = param(0.5, min=0.0, max=1.0, help="initial exploration probability of easy prompts")
    p_hard: float = param(0.5, min=0.0, max=1.0, help="initial exploration probability of hard prompts")


@dataclass
class AsyncConfig:
    enabled: bool = param(False, help="asynchronous training (AReaL): generation runs continuously "
                          "in its own worker while the trainer trains")
    worker: str = param("process", choices=["process", "thread"],
                        help="where the embedded engine decodes: its own process (no contention "
                        "with the trainer for Python's interpreter lock) or a thread")
    worker_threads: int = param(1, min=1, max=256,
                                help="torch threads of the engine process (async.worker=process); "
                                "model.threads is the trainer's")
    max_staleness: int = param(2, min=0, max=64, tunable=True,
                               help="eta: a trained token may come from a policy at most this many "
                               "versions old (0 = the synchronous loop)")
    max_inflight: int = param(0, min=0, max=65536, tunable=True,
                              help="most groups generating at once (0 = 2 x rollout_batch_size); "
                              "never more than 4 x rollout.max_slots samples, whatever this says")
    prox_logp: str = param("recompute", choices=["recompute", "loglinear"],
                           help="proximal logprobs: a forward pass with the pre-update weights, or "
                           "the log-linear interpolation from per-token versions")
    behave_imp_cap: float = param(5.0, min=1.0, max=1000.0, tunable=True,
                                  help="upper bound of the behaviour importance weight pi_prox/pi_b")
    behave_cap_mode: str = param("mask", choices=["mask", "clamp"], tunable=True,
                                 help="tokens whose behaviour weight exceeds the cap: mask them out "
                                 "of the loss, or clamp the weight to the cap")
    auto_staleness: bool = param(False, tunable=True,
                                 help="tighten eta when behaviour importance weights drift from 1, "
                                 "relax it while they stay near 1 (each change is an event)")
    auto_staleness_max: int = param(8, min=0, max=64, tunable=True,
                                    help="auto_staleness never raises eta above this")
    collect_timeout_s: float = param(600.0, min=1.0, max=86400.0, tunable=True,
                                     help="the trainer waits at most this long without any "
                                     "generation progress; then the run stops with an error "
                                     "naming the admission counters (resumable)")


@dataclass
class RunConfig:
    max_steps: int = param(200, min=1, max=10_000_000, help="training steps")
    seed: int = param(0, min=0, max=2**31 - 1, help="seed for data, sampling and init")
    checkpoint_every: int = param(25, min=0, max=10_000_000,
                                  help="save a checkpoint every N steps (0 = only at the end)")
    keep_checkpoints: int = param(2, min=1, max=1000, help="checkpoints kept on disk")
    eval_every: int = param(0, min=0, max=10_000_000, help="held-out evaluation every N steps (0 = never)")
    eval_size: int = param(256, min=1, max=100_000, help="held-out prompts per evaluation")
    eval_temperature: float = param(1.0, min=0.0, max=2.0,
                                    help="sampling temperature of evaluations (0 = greedy)")
    time_budget_s: float = param(0.0, min=0.0, max=1e9, help="stop after this many seconds (0 = no limit)")
    reward_workers: int = param(1, min=0, max=64,
                                help="reward processes (0 = score in the trainer process)")
    reward_timeout_s: float = param(10.0, min=0.1, max=3600.0, help="time limit for one reward batch")
    log_samples: int = param(2, min=0, max=64, tunable=True,
                             help="groups per step recorded whole for the rollout inspector, drawn at "
                             "random, besides the step's longest and shortest sample and every sample "
                             "whose reward failed (0 = record none)")
    report_to: list[str] = param([], choices=TRACKERS,
                                 help="trackers the run's metrics are mirrored to, besides rlpilot's "
                                 "own: TensorBoard event files, W&B, MLflow (each needs its optional "
                                 "package; see docs/trackers.md)")


@dataclass
class ClusterConfig:
    train_procs: int = param(1, min=1, max=1024,
                             help="training processes (torchrun ranks, one per GPU): rank 0 is the "
                             "controller that owns the rollout, every rank trains its share of each "
                             "batch; under an outside torchrun, the world size it gives (recorded)")
    gen_procs: int = param(0, min=0, max=64,
                           help="generation processes of the embedded engine behind one engine "
                           "(balanced by outstanding tokens; one that dies is restarted and its "
                           "samples go on elsewhere), each on its own GPU where there are enough "
                           "(0 = the engine runs in the controller, or in its one asynchronous "
                           "worker process, itself a pool of one)")
    sharding: str = param("ddp", choices=["ddp", "fsdp"],
                          help="how the training ranks hold the model: ddp = each a whole copy "
                          "(DistributedDataParallel), fsdp = each 1/K of the weights, gradients and "
                          "optimizer state (FSDP2 fully_shard; checkpoints sharded, through "
                          "torch.distributed.checkpoint); fsdp needs generation off the training "
                          "ranks (cluster.gen_procs >= 1, or SGLang servers)")


# the pilot's rules whose advice the autopilot may apply (trainer/pilot/: one module each)
AUTOPILOT_RULES = ("staleness", "april", "greso", "health")


@dataclass
class PilotConfig:
    autopilot: list[str] = param([], choices=AUTOPILOT_RULES, tunable=True,
                                 help="rules whose advice the autopilot applies itself, each change an "
                                 "audited knob change by 'autopilot' (empty = advice only; a person's "
                                 "own change to a knob wins: the autopilot leaves that knob alone)")
    bounds: list[str] = param([], tunable=True,
                              help="ranges the autopilot keeps knobs in, as 'key=lo..hi' items, e.g. "
                              "'async.max_staleness=1..8' (a knob not named: its own range)")
    every: int = param(10, min=1, max=500, tunable=True,
                       help="steps between two autopilot changes: each change is watched over this many "
                       "steps and undone when a guard trips")
    guard_throughput_drop: float = param(0.15, min=0.0, max=1.0, tunable=True,
                                         help="undo a change made for throughput when trained tokens/s "
                                         "fell by more than this share over the steps after it")
    guard_accuracy_drop: float = param(0.05, min=0.0, max=1.0, tunable=True,
                                       help="undo any change when the mean accuracy (or reward) fell by "
                                       "more than this over the steps after it")


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "rollout": RolloutConfig,
    "algo": AlgoConfig,
    "optim": OptimConfig,
    "april": AprilConfig,
    "greso": GresoConfig,
    "async": AsyncConfig,
    "run": RunConfig,
    "cluster": ClusterConfig,
    "pilot": PilotConfig,
}

# `async` is a Python keyword: the section is [async] in TOML and dotted keys ("async.
# max_staleness"), and the attribute `Config.async_`.
_ATTR = {"async": "async_"}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    april: AprilConfig = field(default_factory=AprilConfig)
    greso: GresoConfig = field(default_factory=GresoConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    run: RunConfig = field(default_factory=RunConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    pilot: PilotConfig = field(default_factory=PilotConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(self.section(name)) for name in SECTIONS}

    def section(self, name: str):
        return getattr(self, _ATTR.get(name, name))

    def get(self, key: str):
        section, name = _split_key(key)
        return getattr(self.section(section), name)

    def set(self, key: str, value) -> None:
        """Set one validated value (raises ConfigError)."""
        spec = param_spec(key)
        section, name = _split_key(key)
        setattr(self.section(section), name, spec.coerce(value))

    def knob_values(self) -> dict[str, Any]:
        return {p.name: self.get(p.name) for p in schema() if p.tunable}

    def copy(self) -> "Config":
        return copy.deepcopy(self)


# ---------------------------------------------------------------------------------------------
# The schema, derived from the dataclasses above
# ---------------------------------------------------------------------------------------------

_TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "str", list: "list"}


@dataclass(frozen=True)
class ParamSpec:
    name: str  # dotted: "optim.lr"
    type: type
    default: Any
    help: str
    min: float | None = None
    max: float | None = None
    choices: tuple | None = None
    tunable: bool = False

    def as_json(self) -> dict[str, Any]:
        default = list(self.default) if self.type is list else self.default
        return {"name": self.name, "type": _TYPE_NAMES[self.type], "default": default,
                "min": self.min, "max": self.max,
                "choices": list(self.choices) if self.choices else None,
                "help": self.help, "tunable": self.tunable}

    def allowed(self) -> str:
        if self.type is list:
            items = ("names from " + ", ".join(repr(c) for c in self.choices) if self.choices
                     else "strings")
            return f"a list of distinct {items} (a TOML list or comma-separated; empty = none)"
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.type is bool:
            return "true or false"
        lo = "-inf" if self.min is None else self.min
        hi = "inf" if self.max is None else self.max
        if self.type in (int, float):
            return f"{'an integer' if self.type is int else 'a number'} in [{lo}, {hi}]"
        return "a string"

    def coerce(self, value):
        """Return `value` as this parameter's type, or raise ConfigError naming the key."""
        err = ConfigError({self.name: f"got {short_repr(value)}; expected {self.allowed()}"})
        t = self.type
        if t is list:
            return self._coerce_list(value, err)
        if t is bool:
            if isinstance(value, bool):
                out = value
            elif isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                out = value.lower() in ("true", "1", "yes")
            else:
                raise err
        elif t is int:
            if isinstance(value, bool):
                raise err
            if isinstance(value, int):
                out = value
            elif isinstance(value, float) and value.is_integer():
                out = int(value)
            elif isinstance(value, str):
                try:
                    out = int(value.strip())
                except ValueError:
                    raise err from None
            else:
                raise err
        elif t is float:
            if isinstance(value, bool):
                raise err
            if isinstance(value, (int, float)):
                try:
                    out = float(value)
                except OverflowError:  # an integer too large for a float
                    raise err from None
            elif isinstance(value, str):
                try:
                    out = float(value.strip())
                except ValueError:
                    raise err from None
            else:
                raise err
            if not math.isfinite(out):
                raise err
        else:
            if not isinstance(value, str):
                raise err
            problem = text_problem(value, MAX_TEXT_LEN)
            if problem:
                raise ConfigError({self.name: problem})
            out = value
        if self.choices and out not in self.choices:
            raise err
        if self.min is not None and out < self.min:
            raise err
        if self.max is not None and out > self.max:
            raise err
        return out


    def _coerce_list(self, value, err: ConfigError) -> list[str]:
        """A list, a TOML list in a string ('["a", "b"]', from the form or --set) or a
        comma-separated string ('a, b') -> the list; every item checked, duplicates refused."""
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    value = tomllib.loads(f"v = {text}")["v"]
                except (tomllib.TOMLDecodeError, RecursionError):
                    raise err from None
            else:
                value = [item.strip() for item in text.split(",")] if text else []
        if not isinstance(value, (list, tuple)):
            raise err
        out: list[str] = []
        for item in value:
            if not isinstance(item, str) or not item:
                raise ConfigError({self.name: f"item {short_repr(item)}: expected {self.allowed()}"})
            if self.choices and item not in self.choices:
                raise ConfigError({self.name: f"unknown name {short_repr(item)}; expected {self.allowed()}"})
            problem = text_problem(item, MAX_TEXT_LEN)
            if problem:
                raise ConfigError({self.name: problem})
            if item in out:
                raise ConfigError({self.name: f"{item!r} is named twice"})
            out.append(item)
        return out


def _split_key(key: str) -> tuple[str, str]:
    if not isinstance(key, str) or key.count(".") != 1:
        raise ConfigError({str(key): "expected a key of the form section.name, e.g. optim.lr"})
    return tuple(key.split("."))  # type: ignore[return-value]


_SCHEMA: list[ParamSpec] | None = None


def schema() -> list[ParamSpec]:
    """Every parameter, in declaration order."""
    global _SCHEMA
    if _SCHEMA is None:
        specs = []
        for section, cls in SECTIONS.items():
            for f in dataclasses.fields(cls):
                m = f.metadata
                default = (tuple(f.default_factory()) if f.default is dataclasses.MISSING
                           else f.default)   # a list's default as a tuple: the spec is frozen
                specs.append(ParamSpec(name=f"{section}.{f.name}", type=_field_type(f),
                                       default=default, help=m["help"], min=m["min"], max=m["max"],
                                       choices=m["choices"], tunable=m["tunable"]))
        _SCHEMA = specs
    return _SCHEMA


def _field_type(f: dataclasses.Field) -> type:
    t = f.type if isinstance(f.type, type) else {"str": str, "int": int, "float": float,
                                                   "bool": bool, "list[str]": list}[f.type]
    return t


def param_spec(key: str) -> ParamSpec:
    section, name = _split_key(key)
    for p in schema():
        if p.name == key:
            return p
    if section not in SECTIONS:
        raise ConfigError({key: f"unknown section {section!r}; sections are "
                                + ", ".join(SECTIONS)})
    names = [p.name.split(".")[1] for p in schema() if p.name.startswith(section + ".")]
    raise ConfigError({key: f"unknown key {name!r} in [{section}]; known keys: " + ", ".join(names)})


def knobs() -> list[ParamSpec]:
    return [p for p in schema() if p.tunable]


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files(PRESETS_PACKAGE).iterdir()
                  if p.name.endswith(".toml"))


def preset_dict(name: str) -> dict[str, dict[str, Any]]:
    if name not in preset_names():
        raise ConfigError({"preset": f"unknown preset {name!r}; presets: " + ", ".join(preset_names())})
    text = resources.files(PRESETS_PACKAGE).joinpath(name + ".toml").read_text()
    return tomllib.loads(text)


def preset_config(name: str, *, project_dir: str | Path = ".",
                  var_dir: str | Path | None = None) -> "Config":
    """A shipped preset, its relative model.path made whole. A preset names its model relative to
    the project folder (var/models/..., where import-gguf writes by default); var/ there is the
    RLPILOT_VAR_DIR of whoever runs it (default <project_dir>/var). The one rule for the CLI
    (project_dir: where it runs) and the web (the server's project folder and var dir)."""
    cfg = from_dict(preset_dict(name))
    path = cfg.model.path
    if path != "builtin" and not Path(path).is_absolute():
        project = Path(project_dir)
        var = Path(var_dir or os.environ.get("RLPILOT_VAR_DIR") or project / "var")
        head, _, rest = path.partition("/")
        cfg.set("model.path", str((var / rest if head == "var" and rest else project / path).resolve()))
    return cfg


def preset_requires(name: str) -> str | None:
    """What a preset needs beyond the default install, or None. A preset whose model.path is
    not "builtin" needs a model directory of your own: it is opt-in, and the per-preset tests
    (which must pass on a fresh checkout) skip it with this reason."""
    path = preset_dict(name).get("model", {}).get("path", "builtin")
    if path == "builtin":
        return None
    return (f"opt-in preset: needs the model directory model.path = {path!r} "
            "(see docs/models.md)")


def from_dict(data: dict[str, Any], base: Config | None = None) -> Config:
    """Apply a nested {section: {key: value}} mapping to `base` (defaults if None).

    Every error is collected, so the user sees all of them at once."""
    cfg = base.copy() if base is not None else Config()
    errors: dict[str, str] = {}
    if not isinstance(data, dict):
        raise ConfigError({"config": "expected a table of sections"})
    for section, values in data.items():
        if section not in SECTIONS:
            errors[section] = "unknown section; sections are " + ", ".join(SECTIONS)
            continue
        if not isinstance(values, dict):
            errors[section] = "expected a table of keys"
            continue
        for name, value in values.items():
            try:
                cfg.set(f"{section}.{name}", value)
            except ConfigError as e:
                errors.update(e.errors)
    if errors:
        raise ConfigError(errors)
    check(cfg)
    return cfg


def loads_toml(text: str, base: Config | None = None) -> Config:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError({"toml": f"not valid TOML: {e}"}) from None
    except RecursionError:
        raise ConfigError({"toml": "not valid here: nested too deeply"}) from None
    return from_dict(data, base)


def parse_override(item: str) -> tuple[str, Any]:
    """'optim.lr=3e-5' -> ('optim.lr', 3e-5). The value is read as a TOML value when it parses
    as one (numbers, booleans, quoted strings), otherwise taken as a bare string."""
    if "=" not in item:
        raise ConfigError({item: "expected section.key=value"})
    key, raw = item.split("=", 1)
    key, raw = key.strip(), raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def apply_overrides(cfg: Config, overrides: dict[str, Any] | Iterable[str]) -> Config:
    """Apply dotted overrides ({'optim.lr': 1e-5} or ['optim.lr=1e-5']), collecting all errors."""
    if not isinstance(overrides, dict):
        pairs = [parse_override(o) for o in overrides]
    else:
        pairs = list(overrides.items())
    cfg = cfg.copy()
    errors: dict[str, str] = {}
    for key, value in pairs:
        try:
            cfg.set(key, value)
        except ConfigError as e:
            errors.update(e.errors)
    if errors:
        raise ConfigError(errors)
    check(cfg)
    return cfg


def load(source: str, overrides: dict[str, Any] | Iterable[str] = ()) -> Config:
    """Load a preset name or a TOML file path, then apply overrides."""
    path = Path(source)
    if source in preset_names():
        cfg = preset_config(source)
    elif path.suffix == ".toml" and path.is_file():
        cfg = loads_toml(path.read_text())
    else:
        raise ConfigError({"config": f"{source!r} is neither a preset ({', '.join(preset_names())}) "
                                     "nor an existing .toml file"})
    return apply_overrides(cfg, overrides)


def check(cfg: Config) -> None:
    """Rules that involve more than one parameter."""
    errors: dict[str, str] = {}
    if cfg.data.task in ("math", "code") and not cfg.data.path:
        errors["data.path"] = f"task={cfg.data.task!r} needs a JSONL file in data.path"
    if cfg.data.task in ("sum", "arith") and cfg.data.path:
        errors["data.path"] = f"the built-in {cfg.data.task} task reads no file; leave data.path empty"
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
        from trainer.engine.sglang import parse_urls
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
    if cfg.april.segment_max_tokens > cfg.rollout.max_response_len:
        errors["april.segment_max_tokens"] = (f"must not exceed rollout.max_response_len "
                                              f"({cfg.rollout.max_response_len})")
    if errors:
        raise ConfigError(errors)


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


MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 200


def stop_strings(value: str) -> list[str]:
    """`rollout.stop` as a list: "" -> [], '["</answer>", "\\n\\nUser:"]' -> the strings. Raises
    ValueError saying what is wrong (not JSON, not a list of non-empty strings, too many)."""
    import json

    if not value.strip():
        return []
    example = 'expected a JSON list of strings, e.g. ["</answer>"] (empty = none)'
    try:
        out = json.loads(value)
    except (ValueError, RecursionError):
        raise ValueError(f"not valid JSON: {example}") from None
    if not isinstance(out, list) or not all(isinstance(x, str) for x in out):
        raise ValueError(example)
    if any(not x for x in out):
        raise ValueError("a stop string is empty")
    if len(out) > MAX_STOP_STRINGS:
        raise ValueError(f"{len(out)} stop strings; at most {MAX_STOP_STRINGS}")
    for i, x in enumerate(out):  # the same text rules as every config string, after decoding
        problem = text_problem(x, MAX_STOP_LEN)
        if problem:
            raise ValueError(f"stop string {i + 1}: {problem}")
    return list(dict.fromkeys(out))


def apply_knob_change(cfg: Config, knobs: dict[str, Any]) -> tuple[Config, dict[str, dict]]:
    """A knob change as a whole: the new config and {key: {"old", "new"}}, or ConfigError with
    every key that is unknown, not tunable or out of range (nothing is applied then)."""
    errors: dict[str, str] = {}
    for key, value in knobs.items():
        try:
            spec = param_spec(key)
            if not spec.tunable:
                raise ConfigError({key: "cannot change during a run"})
            spec.coerce(value)
        except ConfigError as e:
            errors.update(e.errors)
    if errors:
        raise ConfigError(errors)
    new = apply_overrides(cfg, knobs)
    return new, {k: {"old": cfg.get(k), "new": new.get(k)} for k in knobs}


# NUL (PostgreSQL refuses it) and lone UTF-16 surrogates (no UTF-8 encoding)
UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
MAX_TEXT_LEN = 100_000  # characters of one config string (a prompt template, a system prompt)


def short_repr(value, limit: int = 80) -> str:
    """repr() cut to `limit` characters: error messages name a bad value, never echo it whole."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit - 12] + f"... ({len(r)} chars)"


def text_problem(value: str, max_len: int) -> str | None:
    """Why `value` cannot be stored (UTF-8, PostgreSQL text/JSON, TOML), or None. Lone UTF-16
    surrogates have no UTF-8 encoding; NUL is refused by PostgreSQL."""
    if len(value) > max_len:
        return f"too long: {len(value)} characters (at most {max_len})"
    bad = UNSTORABLE.search(value)
    if bad:
        ch = bad.group()
        what = "a NUL character" if ch == "\x00" else f"a lone UTF-16 surrogate (U+{ord(ch):04X})"
        return f"contains {what} at character {bad.start()}"
    return None


def to_toml(cfg: Config) -> str:
    """Serialise a config as TOML (round-trips through loads_toml)."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            lines.append(f"{k} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + "".join(_TOML_ESCAPES.get(ch) or _toml_char(ch) for ch in str(v)) + '"'


# TOML basic strings: these escapes, and \uXXXX for every other control character
_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n",
                 "\f": "\\f", "\r": "\\r"}


def _toml_char(ch: str) -> str:
    return f"\\u{ord(ch):04X}" if ch < " " or ch == "\x7f" else ch
