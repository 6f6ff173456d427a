"""Wiring a run: the collaborators a Runner holds, made once for every rank role.

Under torchrun a run has K training processes (trainer/cluster/distributed.py; K = 1 otherwise).
Every rank holds the policy, its learner (with the reference when the run measures or penalises
KL: `track_reference`) and the tokenizer. Rank 0, the controller, also holds what rolls out and
reports: the task and its prompts, the engine, the rollout driver with its prompt selector
(GRESO) and scorer (the reward pool), the step boundary, the pilot, the inspector's recorder,
the timeline and the telemetry. The other ranks hold None for the engine, the reward pool and the
telemetry (trainer/run/training_ranks.py sends them their share of each update).

`collaborators` returns them as one `RunParts` (trainer/run/parts.py declares them), which the
Runner holds as its attributes (runner.engine, runner.rollout, ...). A resumed run:
`checkpoint_and_config` (rank 0 reads the latest checkpoint, every rank gets its config) before
the collaborators, `resume_state` (every rank takes its part of the checkpoint) after.
"""
from __future__ import annotations

import threading

import torch

from trainer import config as config_mod
from trainer import sandbox
from trainer.accounting.inspector import InspectorRecorder
from trainer.agents import endpoint
from trainer.algo.learner import Learner
from trainer.cluster import sharding
from trainer.episode.engine import Episodes
from trainer.models import lora
from trainer.models.loading import load_model, load_tokenizer, resolve_device, resolve_dtype
from trainer.observe.system import ProcessMeter, SystemSampler
from trainer.observe.timeline import CONTROLLER, TOOLS_LANE, Timeline
from trainer.pilot.live import LivePilot
from trainer.rewards.pool import RewardService
from trainer.rollout import PromptSource, build_driver
from trainer.rollout.scoring import Scorer
from trainer.rollout.selection import PromptSelector
from trainer.run import state as run_state
from trainer.run import warm_start
from trainer.run.boundary import StepBoundary
from trainer.run.engines import build_engine
from trainer.run.parts import RunParts
from trainer.tasks import build_task


def track_reference(cfg) -> bool:
    """Does the learner keep the base model as a reference? When the run measures the KL to it
    (algo.track_kl) or penalises it (algo.kl_coef > 0)."""
    return cfg.algo.track_kl or cfg.algo.kl_coef > 0


def checkpoint_and_config(run, resume: bool, keep_knobs=()):
    """Rank 0 reads the latest checkpoint when resuming (its knob values win over the config's,
    except `keep_knobs`); every rank sets `run.cfg` to rank 0's config, with the layout torchrun
    gave (checked again when it has several processes). Returns (resumed: (checkpoint path,
    its model in DCP shards) or None, and rank 0's checkpoint state and tensors, else None)."""
    state = tensors = resumed = None
    if resume and run.dist.is_main:
        path, state, tensors, run.cfg = run_state.load_latest(run.run_dir, run.cfg, keep_knobs)
        resumed = (path, sharding.is_sharded(path))
    run.cfg, resumed = run.dist.broadcast_object((run.cfg, resumed))
    run.cfg.cluster.train_procs = run.dist.size     # the layout torchrun gave, recorded
    if run.dist.size > 1:
        config_mod.check(run.cfg)   # e.g. fsdp with the engine in rank 0: refused by name
    return resumed, state, tensors


def collaborators(run, resumed, tensors, *, system_telemetry: bool) -> RunParts:
    """The parts `run` works with in its rank role (read from it: its config, process group,
    run directory, sink, controls and totals). `resumed`: (checkpoint path, its model in DCP
    shards) or None; `tensors`: rank 0's checkpoint tensors (a sharded checkpoint's whole
    optimizer state is read into them when this run is not sharded)."""
    cfg, controller = run.cfg, run.dist.is_main
    # before any process is started: reward workers and generation processes inherit it
    sandbox.use(cfg.sandbox.isolation)
    if cfg.model.threads:
        torch.set_num_threads(cfg.model.threads)
    torch.manual_seed(cfg.run.seed)
    device = run.dist.local_device(resolve_device(cfg.model.device))
    dtype = resolve_dtype(cfg.model.dtype, device)
    tokenizer = load_tokenizer(cfg.model.path)
    # rank 0 resumes an unsharded checkpoint's weights; a sharded checkpoint's are read into the
    # base model later (by every rank), and DDP's wrap gives the other ranks rank 0's weights
    resumes_weights = controller and resumed is not None
    reference = None   # else the learner copies the model it is given: the base weights
    if lora.enabled(cfg):   # the base, frozen, with adapters: fresh, or the checkpoint's
        base = load_model(cfg.model.path, device, dtype)
        model = (lora.load(base, resumed[0] / "model") if resumes_weights and not resumed[1]
                 else lora.wrap(base, cfg)).eval()   # a sharded checkpoint's: read below
        # the checkpoint's adapter config has the dropout it was written with: this run's wins
        lora.set_dropout(model, cfg.lora.dropout)
    else:
        policy_path = (str(resumed[0] / "model") if resumes_weights and not resumed[1]
                       else cfg.model.path)
        model = load_model(policy_path, device, dtype).eval()
        if resumes_weights and track_reference(cfg):
            reference = load_model(cfg.model.path, device, dtype)
    if resumes_weights and resumed[1] and not run.sharded:   # sharded before, whole now
        tensors["optimizer"] = sharding.read_whole(resumed[0], model)
    task = prompts = engine = None
    max_seq_len = 0
    if controller:   # before the learner: generation processes copy the model whole, which sharding splits
        task, prompts, engine, max_seq_len = _generation(run, model, tokenizer, device, dtype)
    learner = Learner(model, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                      track_reference=track_reference(cfg), reference=reference,
                      dist=run.dist, sharded=run.sharded)
    parts = RunParts(device, dtype, tokenizer, model, learner, task=task, prompts=prompts,
                     engine=engine, max_seq_len=max_seq_len)
    if controller:
        _rollout(run, parts, system_telemetry)
    return parts


def _generation(run, model, tokenizer, device, dtype):
    """Rank 0: the task, its prompts and the engine that generates for them."""
    cfg = run.cfg
    task = build_task(cfg, tokenizer)  # prompts rendered for its chat template
    # LoRA: the embedded engine holds the base (a plain copy, made once) and merges the adapters'
    # factors each update sends; SGLang servers reload whole merged models
    served, adapter = model, None
    if lora.engine_holds_base(cfg):
        served, adapter = lora.base_copy(model), lora.adapter_update(model)
    elif lora.enabled(cfg):
        served = lora.merged_copy(model)
    max_seq_len = task.max_sequence_len(tokenizer, cfg)
    if cfg.episode.agents:   # agents' conversations: as long as the model takes
        max_seq_len = endpoint.max_positions(model, max_seq_len)
    engine = build_engine(cfg, served, tokenizer, device, dtype, max_seq_len,
                          weights_dir=run.run_dir / "engine_weights", adapter=adapter)
    return task, PromptSource(task), engine, max_seq_len


def _rollout(run, parts: RunParts, system_telemetry: bool) -> None:
    """Rank 0: the rollout driver and what it draws, scores and reports with; the step
    boundary, the pilot, the inspector's recorder, the timeline and the telemetry."""
    cfg, p = run.cfg, parts
    # prompts, GRESO state and the reward pool are shared with the async generation worker
    p.lock = threading.RLock()
    p.selector = PromptSelector(p.prompts, p.task.train_size, cfg, p.lock)
    p.greso = p.selector.filter  # the GRESO state (checkpoints, tests)
    p.rewards = RewardService(workers=cfg.run.reward_workers, timeout_s=cfg.run.reward_timeout_s)
    p.scorer = Scorer(p.rewards, p.tokenizer, lambda: run.cfg, run.totals, p.lock)  # live knobs
    if cfg.episode.agents:   # the groups come from agents over the endpoint
        p.rollout = endpoint.build(cfg, p.engine, p.tokenizer, p.scorer, run.run_dir,
                                   p.max_seq_len, lambda: run.cfg, token=run.agent_token)
    else:
        p.rollout = build_driver(cfg, p.engine, p.tokenizer, p.selector, p.scorer, p.lock)
    p.samples = InspectorRecorder(p.tokenizer, cfg.run.seed)  # the rollout inspector's
    timeline = p.timeline = Timeline(fill={CONTROLLER: "bookkeeping"})
    if isinstance(p.engine, Episodes):   # each tool call, on the timeline's tools lane
        p.engine.on_tool = lambda start, end: timeline.add(TOOLS_LANE, "tool", start, end)
    p.boundary = StepBoundary(run.controls, run.sink, p.rollout)
    p.pilot = LivePilot()   # advice events and the autopilot (trainer/pilot/)
    p.system = SystemSampler(use_gpu=p.device.type == "cuda") if system_telemetry else None
    p.meter = ProcessMeter()   # CPU and memory per process (timeline lane)


def resume_state(run, resumed, state, tensors) -> None:
    """Every rank: the checkpoint's state (rank 0; a new run writes its config instead, and
    takes another run's GRESO statistics with greso.warm_start), the optimizer's, and the
    generators' first weights."""
    if run.dist.is_main:
        if state is not None:
            run_state.restore(run, state, tensors)
        else:
            run.greso_warm = warm_start.apply(run.greso, run.task, run.cfg)
            (run.run_dir / "config.toml").write_text(config_mod.to_toml(run.cfg))
    _restore_optimizer(run, resumed, tensors)
    only_changed = lora.engine_holds_base(run.cfg)   # LoRA: the factors alone
    if run.dist.is_main and (run.cfg.rollout.engine != "embedded" or run.sharded):
        # servers hold whatever weights they were started with, generation processes the
        # base model's when a sharded checkpoint was resumed: push the policy's
        run.engine.update_weights(run.learner.full_state_dict(only_changed), run.version)
    elif not run.dist.is_main and run.sharded:
        run.learner.full_state_dict(only_changed)   # rank 0's first push: a collective


def _restore_optimizer(run, resumed, tensors) -> None:
    """Every rank: the resumed optimizer state (and a sharded checkpoint's weights). Sharded
    now: each rank reads its shards of a sharded checkpoint, or rank 0 spreads an unsharded
    one's; replicated: rank 0's state (run_state.restore loaded it) to the others."""
    learner, dist = run.learner, run.dist
    if run.sharded:
        if resumed is not None and resumed[1]:
            sharding.load(resumed[0], learner.model, learner.optimizer)
        elif resumed is not None:
            sharding.spread_optimizer_from_rank0(learner.model, learner.optimizer,
                                                 tensors["optimizer"] if dist.is_main else None)
        return
    optimizer = dist.broadcast_object(learner.state_dict()
                                      if dist.is_main and resumed is not None else None)
    if optimizer is not None and not dist.is_main:
        learner.load_state_dict(optimizer)
