"""GPU code paths. They need CUDA and are skipped (with the reason) on machines without it;
on a GPU machine: `pytest tests/test_gpu.py`."""
import pytest
import torch

from trainer import config as C
from trainer.engine.base import Sample, SamplingParams
from trainer.engine.embedded import EmbeddedEngine
from trainer.models.loading import load_model, load_tokenizer
from trainer.observe.metrics import MemorySink
from trainer.observe.system import SystemSampler
from trainer.run.runner import Runner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_bf16_training_steps_report_peak_memory_and_gpu_telemetry(tmp_path):
    cfg = C.load("demo", ["model.device=cuda", "rollout.rollout_batch_size=8",
                          "rollout.n_samples_per_prompt=4", "run.max_steps=3",
                          "run.eval_every=0", "run.checkpoint_every=0"])
    sink = MemorySink()
    with Runner(cfg, tmp_path, sink=sink) as r:
        assert r.run() == "finished"
        assert r.dtype == torch.bfloat16 and next(r.model.parameters()).is_cuda
    peaks = sink.series("system/cuda_peak_mem_gb")
    assert len(peaks) == 3 and all(p > 0 for p in peaks)
    assert "system/gpu_util" in sink.steps[-1] and "system/gpu0/mem_gb" in sink.steps[-1]


def test_kv_cache_release_returns_memory_and_results_stay_the_same():
    model = load_model("builtin", torch.device("cuda"), torch.float32).eval()
    tok = load_tokenizer("builtin")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=64)
    eng = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], max_slots=64, max_seq_len=256)
    a = Sample(tok("[1,2,3,4]=").input_ids, greedy)
    eng.generate([a])
    before = torch.cuda.memory_allocated()
    eng.release_memory()
    assert torch.cuda.memory_allocated() < before
    b = Sample(tok("[1,2,3,4]=").input_ids, greedy)
    eng.generate([b])
    assert b.response_ids == a.response_ids


def test_nvml_sampler_sees_the_devices():
    s = SystemSampler(interval_s=0.1).start()
    try:
        m = s.summary()
    finally:
        s.close()
    assert s.has_gpu and 0 <= m["system/gpu_util"] <= 100


def test_async_process_worker_decodes_on_cuda(tmp_path):
    cfg = C.load("demo", ["model.device=cuda", "async.enabled=true", "async.worker=process",
                          "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
                          "run.max_steps=2", "run.eval_every=0", "run.checkpoint_every=0"])
    with Runner(cfg, tmp_path, sink=MemorySink()) as r:
        info = r.engine.members[0].engine.child_info   # a pool of one generation process
        assert info["device"].startswith("cuda")
        assert info["dtype"] == str(r.dtype)
        assert r.run() == "finished"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL: one rank per GPU)")
def test_two_nccl_ranks_train_the_all_preset_with_one_controller(tmp_path):
    """The scale-out layout on GPUs: torchrun, NCCL, rank 0 the controller (docs/scaling.md)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "trainer", "run", "all", "--out", str(out)]
    for o in ("model.device=cuda", "run.max_steps=3", "rollout.rollout_batch_size=8",
              "rollout.n_samples_per_prompt=4", "run.eval_every=0", "run.checkpoint_every=0"):
        cmd += ["--set", o]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], env=dict(os.environ),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["dist/world_size"] == 2
    assert all(r["async/staleness/max"] <= 2 for r in rows)
