"""What a run works with, declared in one place: `RunParts`.

trainer/run/build.py makes them once for the process's rank role; the Runner holds each as its
attribute of the same name (`runner.engine` is `parts.engine`). Every rank holds the first five;
rank 0, the controller, also holds what rolls out, scores, reports and takes controls, which the
other training ranks hold as None (trainer/run/training_ranks.py sends them their share).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from trainer.accounting.inspector import InspectorRecorder
from trainer.algo.learner import Learner
from trainer.engine.base import RolloutEngine
from trainer.observe.system import ProcessMeter, SystemSampler
from trainer.observe.timeline import Timeline
from trainer.pilot.live import LivePilot
from trainer.rewards.pool import RewardService
from trainer.rollout.base import Driver, PromptSource
from trainer.rollout.greso import GresoFilter
from trainer.rollout.scoring import Scorer
from trainer.rollout.selection import PromptSelector
from trainer.run.boundary import StepBoundary
from trainer.tasks.base import Task


@dataclass
class RunParts:
    # every rank
    device: torch.device
    dtype: torch.dtype
    tokenizer: Any                 # the model's tokenizer (transformers' or the built-in one)
    model: torch.nn.Module         # the policy (LoRA: the base with adapters)
    learner: Learner               # the update, with the reference model when KL is tracked
    # rank 0 alone
    task: Task | None = None       # the problems and their prompts
    prompts: PromptSource | None = None       # the data cursor
    engine: RolloutEngine | None = None       # generates (embedded, its processes, SGLang)
    max_seq_len: int = 0                      # the engine's positions per sequence
    lock: threading.RLock | None = None       # prompts, GRESO and reward totals, shared with
                                              # the asynchronous generation worker
    selector: PromptSelector | None = None    # which prompt comes next (GRESO's pre-filter)
    greso: GresoFilter | None = None          # the selector's GRESO state (checkpoints, tests)
    rewards: RewardService | None = None      # the reward pool
    scorer: Scorer | None = None              # rewards for complete groups, shaped and counted
    rollout: Driver | None = None             # produces each step's groups
    samples: InspectorRecorder | None = None  # the rollout inspector's record
    timeline: Timeline | None = None          # where each process's time went
    boundary: StepBoundary | None = None      # knob changes, pause, stop between two steps
    pilot: LivePilot | None = None            # advice and the autopilot
    system: SystemSampler | None = None       # the machine's telemetry (None: switched off)
    meter: ProcessMeter | None = None         # CPU and memory of each process
