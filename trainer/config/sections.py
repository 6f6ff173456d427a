"""The sections of a config: every parameter is declared exactly once, here, as a dataclass field
made with `param()`: its type, default, allowed range or choices, one line of help, and whether it
may change while a run is going ("tunable", i.e. a knob). `schema()` (trainer/config/schema.py,
with the `Config` holding one of each section) reads them back as `ParamSpec`s; the CLI, the
launch form, the live-tuning panel, the JSON API and docs/configuration.md all read that, and
nothing else lists parameters."""
from __future__ import annotations

from dataclasses import dataclass

from trainer.config.params import param

# model.path names of the models rlpilot ships -> their folder in trainer/assets (the one place
# they are named; trainer/models/loading.py loads them)
BUILTIN_MODELS = {"builtin": "builtin-sum", "builtin-tools": "builtin-tools"}
# the model directories `python -m trainer import-gguf SOURCE` writes by default -> SOURCE (a
# preset naming one says how to make it; trainer/models/gguf_import.py writes them)
IMPORTED_MODELS = {"smollm2-135m-instruct": "smollm2"}

# what run.report_to may name (trainer/observe/trackers/: one adapter each)
TRACKERS = ("tensorboard", "wandb", "mlflow")


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
class LoraConfig:
    rank: int = param(0, min=0, max=1024, help="LoRA: the adapters' rank r (0 = off: full "
                      "fine-tuning). The base weights stay frozen; the KL reference is the base "
                      "(adapters off)")
    alpha: float = param(16.0, min=0.001, max=100_000.0,
                         help="LoRA: the adapters' scale is alpha / rank")
    dropout: float = param(0.0, min=0.0, max=0.9, help="LoRA: dropout on the adapters' input "
                           "while training; keep 0 for RL (it adds noise to the PPO ratio)")
    target_modules: str = param("all-linear", help="LoRA: the linear layers that get adapters, "
                                "comma-separated (q_proj,v_proj,...), or all-linear (every one "
                                "but the output head)")


@dataclass
class DataConfig:
    task: str = param("sum", choices=["sum", "math", "code", "arith", "calc", "drift"],
                      help="built-in list-sum task, a JSONL file of math or code problems, "
                      "arith: built-in arithmetic and word problems scored as math (\\boxed{} "
                      "answers), calc: list sums with a calculator tool (multi-turn), or drift: "
                      "list sums that get easier at data.drift_step under the same ids")
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
    drift_step: int = param(0, min=0, max=10_000_000,
                            help="drift task: the first training step whose problems are drawn "
                            "shifted (every even row a short list; 0 = never shifts)")
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
    dtype: str = param("auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="the engine's precision, apart from the trainer's (model.dtype): auto "
                       "= the trainer's; embedded engine and pool: any; SGLang: the servers' "
                       "--dtype, checked against this (docs/engines.md)")
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
                                         "using the engine's logprobs (a mismatch.correction "
                                         "does too)")


@dataclass
class MismatchConfig:
    measure: bool = param(True, tunable=True,
                          help="measure how far the engine's log-probabilities are from the "
                          "trainer's each step (mismatch/*; one more forward pass where the loss "
                          "does not recompute pi_old already)")
    correction: str = param("off", choices=["off", "truncate", "mask", "band"], tunable=True,
                            help="correct the loss by pi_old / pi_rollout (pi_old then the "
                            "trainer's): truncate = TIS, min(w, upper); mask = MIS, w inside "
                            "[lower, upper] else 0 (IcePop at level token); band = rejection "
                            "without reweighting, 1 inside else 0")
    level: str = param("token", choices=["token", "sequence", "geometric"], tunable=True,
                       help="the correction's ratio: per token, the sequence's product, or its "
                       "geometric mean per token")
    lower: float = param(0.5, min=0.0, max=1.0, tunable=True,
                         help="lower end of the band (mask, band, and the outside-band figure)")
    upper: float = param(2.0, min=1.0, max=1000.0, tunable=True,
                         help="upper end of the band, and the truncation cap")


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
    forget_half_life: float = param(0.0, min=0.0, max=1_000_000.0, tunable=True,
                                    help="forgetting: a zero-variance record this many steps old "
                                    "skips half as often (its keep probability moves back toward "
                                    "1 as it ages); 0 = never forgets")
    warm_start: str = param("", help="a run directory whose latest checkpoint's GRESO statistics "
                            "a new run starts from (p_easy, p_hard, the history of the prompts "
                            "both share by problem id); empty = a cold start. A resume keeps its "
                            "own")


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
    staleness_schedule: str = param(
        "", tunable=True,
        help="eta by step, 'STEP:ETA, ...' (e.g. '0:0, 50:2, 200:4': eta 0 from the start, 2 after "
        "step 50, 4 after step 200); each point is a knob change of max_staleness at the boundary "
        "after its step (by 'schedule'); a person, the autopilot or auto_staleness may move eta "
        "between points; changed mid-run, only its points after that step apply; empty = none")
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
class EpisodeConfig:
    max_turns: int = param(1, min=1, max=64, tunable=True,
                           help="model turns per episode (1 = single-turn: no environment); a tool "
                           "call or feedback ends a turn, the episode's answer ends it")
    tools: str = param("calculator", help="tools the model may call, comma-separated: calculator, "
                       "python (run in the code sandbox); empty = none")
    feedback: bool = param(False, tunable=True,
                           help="after a wrong final answer, tell the model and let it try again "
                           "(while turns are left)")
    tool_timeout_s: float = param(5.0, min=0.1, max=120.0, tunable=True,
                                  help="wall-clock limit of one tool call (python); past it the "
                                  "tool's message is a timeout error")
    tool_output_chars: int = param(500, min=16, max=100_000, tunable=True,
                                   help="longest tool result written back, in characters (cut "
                                   "beyond, marked)")
    tool_workers: int = param(2, min=1, max=64, help="tool calls run at once, beside decoding")

    @property
    def multi_turn(self) -> bool:
        """Turns after the first, with an environment to answer them: the one reading of
        `max_turns` (1 = single-turn) that every package asks."""
        return self.max_turns > 1


@dataclass
class SandboxConfig:
    isolation: str = param("bwrap", choices=["bwrap", "process"],
                           help="where model-written code runs (the python tool, the code "
                           "reward): bwrap = an isolation boundary (namespaces, seccomp, cgroup; "
                           "needs bubblewrap); process = limits and an audit hook only, not a "
                           "boundary, said on the run page and report (docs/sandbox.md)")


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
    target_accuracy: float = param(0.0, min=0.0, max=1.0, tunable=True,
                                   help="a held-out accuracy the forecast counts the steps, time and "
                                   "price to, from the evaluations' trend (0 = none; needs "
                                   "run.eval_every); the run does not stop at it")
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
AUTOPILOT_RULES = ("staleness", "april", "greso", "health", "mismatch")


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


@dataclass
class CostConfig:
    gpu_hour: float = param(0.0, min=0.0, max=1e6, tunable=True,
                            help="price of one GPU-hour in the run's cost account (0 = the "
                            "deployment's RLPILOT_RATE_GPU_HOUR; none anywhere: hours only). A "
                            "change prices the whole run again (docs/cost.md)")
    cpu_core_hour: float = param(0.0, min=0.0, max=1e6, tunable=True,
                                 help="price of one CPU core-hour in the run's cost account (0 = "
                                 "the deployment's RLPILOT_RATE_CPU_CORE_HOUR)")
