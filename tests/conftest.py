import os

import pytest
import torch

# Two cores are shared by the test process and any reward workers: keep torch to one thread
# so timings stay sane and results reproducible.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_RUN = ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
            "rollout.max_response_len=64", "rollout.max_slots=16", "run.eval_every=0",
            "run.checkpoint_every=0", "run.reward_workers=0", "model.threads=1"]


@pytest.fixture
def tiny_overrides():
    return list(TINY_RUN)
