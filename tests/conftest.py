import os

import pytest
import torch
from helpers import TINY_RUN

# Two cores are shared by the test process and any reward workers: keep torch to one thread
# so timings stay sane and results reproducible.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")



@pytest.fixture
def tiny_overrides():
    return list(TINY_RUN)
