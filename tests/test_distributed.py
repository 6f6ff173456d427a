"""Data-parallel training (trainer/distributed.py) with two CPU processes on the gloo backend.

- the learner: one update split over two ranks (unevenly, and with one rank holding nothing)
  equals the single-process update on the union of the sequences;
- the runner: two ranks stay identical, split the prompts without duplicates, only rank 0
  writes metrics/checkpoints, a knob change reaches both ranks before the same step, and what
  data parallelism does not support is refused by name;
- the CLI under torchrun.

Sampling differs between a 2-process and a 1-process run on the same prompts (the engine draws
one random number stream per decode batch, and the batches differ), so the end-to-end runs are
compared on the properties above, and the exact equivalence is checked on the update itself.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from trainer import config as C
from trainer import distributed
from trainer.controls import SET_KNOBS, STOP, Command, ControlSource
from trainer.learner import Learner, TrainSequence
from trainer.metrics import JsonlSink

ROOT = Path(__file__).resolve().parents[1]
TINY = ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
        "rollout.max_response_len=48", "rollout.max_slots=16", "run.eval_every=0",
        "run.checkpoint_every=0", "run.reward_workers=0", "model.threads=1"]
pytestmark = pytest.mark.timeout(180)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, size: int, port: int) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "RLPILOT_DIST_TIMEOUT_S": "90"})
    torch.set_num_threads(1)


def _spawn(fn, *args) -> None:
    mp.spawn(fn, args=args, nprocs=2, join=True)


def _finish() -> None:
    """Leave the group and end the process as the CLI does (distributed.exit_process: gloo
    threads may abort a process in interpreter shutdown)."""
    distributed.destroy()
    distributed.exit_process(0)


# --- the update ------------------------------------------------------------------------------------

def _sequences(n=12, seed=0) -> list[TrainSequence]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p, r = int(torch.randint(2, 8, (1,), generator=g)), int(torch.randint(1, 24, (1,), generator=g))
        ids = torch.randint(4, 30, (p + r,), generator=g).tolist()
        old = (-0.5 - 2 * torch.rand(r, generator=g)).tolist()
        out.append(TrainSequence(ids[:p], ids[p:], old, float(torch.randn(1, generator=g)), 1.0))
    return out


SPLITS = [(slice(0, 9), slice(9, 12)), (slice(0, 12), slice(12, 12))]  # uneven; rank 1 empty
KW = dict(pad_id=0, lr=1e-3, grad_clip=0.5, clip_low=0.2, clip_high=0.28, kl_coef=0.1,
          micro_batch_tokens=64)


def _learner(world=None):
    from trainer.model import load_model

    torch.manual_seed(0)
    model = load_model("builtin", torch.device("cpu"), torch.float32)
    return Learner(model, lr=1e-3, weight_decay=0.0, track_reference=True, dist=world)


def _updates(learner, pick):
    seqs, out = _sequences(), []
    for split in SPLITS:
        metrics = learner.update(seqs[pick(split)], **KW)
        grads = {n: p.grad.clone() for n, p in learner.model.named_parameters()}
        out.append((metrics, grads))
    return out, {n: p.detach().clone() for n, p in learner.model.named_parameters()}


def _update_worker(rank, port, out_dir):
    _join(rank, 2, port)
    world = distributed.init("cpu")
    assert world.size == 2 and world.backend == "gloo"
    steps, weights = _updates(_learner(world), lambda split: split[rank])
    torch.save({"steps": steps, "weights": weights}, Path(out_dir) / f"rank{rank}.pt")
    _finish()


def test_update_split_over_two_ranks_equals_the_single_process_update(tmp_path):
    _spawn(_update_worker, _free_port(), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    single_steps, single_weights = _updates(_learner(), lambda split: slice(0, 12))
    for name in single_weights:  # the ranks apply the same averaged gradients: bit-identical
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name
    for (m0, g0), (m1, _), (ms, gs) in zip(ranks[0]["steps"], ranks[1]["steps"], single_steps):
        assert m0 == m1
        for key in ("actor/loss_tokens", "actor/pg_loss", "actor/kl", "actor/entropy",
                    "actor/clip_ratio", "actor/grad_norm"):
            assert m0[key] == pytest.approx(ms[key], rel=1e-5, abs=1e-8), key
        for name, g in gs.items():  # the global token mean's gradient (after global clipping)
            torch.testing.assert_close(g0[name], g, rtol=1e-4, atol=1e-7, msg=name)
    # the weights, where there is a gradient: Adam's first steps move every weight by about
    # lr x sign(gradient), so where the exact gradient is zero (k_proj.bias: softmax ignores a
    # bias shared by all keys) float noise alone picks the direction, in both runs
    for name, w in single_weights.items():
        live = torch.maximum(single_steps[0][1][name].abs(), single_steps[1][1][name].abs()) > 1e-6
        torch.testing.assert_close(ranks[0]["weights"][name][live], w[live], rtol=0, atol=5e-6,
                                   msg=name)


# --- the runner ------------------------------------------------------------------------------------

class Scripted(ControlSource):
    def __init__(self, script):
        self.script = list(script)

    def poll(self):
        return self.script.pop(0) if self.script else []


def _runner_worker(rank, port, run_dir):
    from trainer.runner import Runner

    _join(rank, 2, port)
    run_dir = Path(run_dir)
    # refused by name before anything is loaded
    refused = {}
    for extra in (["async.enabled=true"], ["rollout.rollout_batch_size=3"]):
        try:
            Runner(C.load("demo", TINY + extra), run_dir / "refused")
        except C.ConfigError as e:
            refused.update(e.errors)
    cfg = C.load("demo", TINY + ["run.max_steps=2"])
    if rank == 0:  # before step 1: a change data parallelism refuses; before step 2: one it takes
        controls = Scripted([[Command(SET_KNOBS, knobs={"april.enabled": True})],
                             [Command(SET_KNOBS, knobs={"optim.lr": 5e-5,
                                                        "rollout.temperature": 0.7})]])
    else:  # never read: only rank 0's controls count
        controls = Scripted([[Command(STOP)]])
    runner = Runner(cfg, run_dir, sink=JsonlSink(run_dir / f"sink{rank}"), controls=controls,
                    system_telemetry=False)
    draws, seen = [], []
    pull = runner.prompts.next

    def next_prompt():
        draw, problem = pull()
        draws.append(draw)
        return draw, problem

    runner.prompts.next = next_prompt
    train_step = runner.train_step

    def step():
        seen.append({"step": runner.step + 1, "lr": runner.cfg.optim.lr,
                     "temperature": runner.cfg.rollout.temperature,
                     "april": runner.cfg.april.enabled})
        return train_step()

    runner.train_step = step
    with runner:
        status = runner.run()
    weights = {n: p.detach().clone() for n, p in runner.model.named_parameters()}
    rng = runner.engine.generator.get_state()
    # resume: every rank loads the same checkpoint, and its own sampling RNG stream
    resumed = Runner(C.load("demo", TINY + ["run.max_steps=3"]), run_dir, resume=True,
                     sink=JsonlSink(run_dir / f"sink{rank}"), system_telemetry=False)
    same_rng = torch.equal(resumed.engine.generator.get_state(), rng)
    start = (resumed.step, resumed.prompts.cursor, resumed.cfg.optim.lr)
    pull = resumed.prompts.next
    resumed.prompts.next = next_prompt
    with resumed:
        resumed.run()
    torch.save({"status": status, "draws": draws, "seen": seen, "weights": weights,
                "refused": refused, "totals": runner.totals, "cursor": runner.prompts.cursor,
                "same_rng": same_rng, "start": start,
                "resumed": {n: p.detach().clone() for n, p in resumed.model.named_parameters()}},
               run_dir / f"rank{rank}.pt")
    _finish()


def test_two_ranks_train_in_step_and_only_rank_0_reports(tmp_path):
    _spawn(_runner_worker, _free_port(), str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["status"] == r1["status"] == "finished"
    for name, w in r0["weights"].items():
        assert torch.equal(w, r1["weights"][name]), name
    # prompts: each rank 2 per step, none twice, together exactly the single-process draws
    assert sorted(r0["draws"][:4] + r1["draws"][:4]) == list(range(8))
    assert not set(r0["draws"]) & set(r1["draws"])
    assert r0["cursor"] == r1["cursor"] == 8
    # the knob change sent to rank 0 before step 2 is applied on both ranks before step 2
    assert r0["seen"] == r1["seen"] == [
        {"step": 1, "lr": C.load("demo").optim.lr, "temperature": 1.0, "april": False},
        {"step": 2, "lr": 5e-5, "temperature": 0.7, "april": False}]
    # metrics, events and the checkpoint come from rank 0 only, with global values
    assert (tmp_path / "sink1" / "metrics.jsonl").read_text() == ""
    assert (tmp_path / "sink1" / "events.jsonl").read_text() == ""
    rows = [json.loads(x) for x in (tmp_path / "sink0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # 3: the resumed run below
    rows = rows[:2]
    assert rows[-1]["dist/world_size"] == 2
    assert [r["rollout/samples"] for r in rows] == [16, 16]  # 4 groups x 4 over both ranks
    assert rows[-1]["train/samples_total"] == 32 == r0["totals"]["samples"] == r1["totals"]["samples"]
    assert r0["totals"] == r1["totals"]
    assert rows[-1]["train/trained_tokens_total"] == r0["totals"]["trained_tokens"]
    assert rows[-1]["actor/lr"] == 5e-5
    for r in rows:
        assert 0.0 <= r["reward/accuracy"] <= 1.0 and r["rollout/response_len/max"] >= r[
            "rollout/response_len/mean"] >= 0
    hists = [json.loads(x) for x in (tmp_path / "sink0" / "histograms.jsonl").read_text().splitlines()]
    assert [sum(h["counts"]) for h in hists] == [16, 16, 16]
    events = [json.loads(x) for x in (tmp_path / "sink0" / "events.jsonl").read_text().splitlines()]
    rejected = [e for e in events if e["kind"] == "knob_rejected"]
    assert len(rejected) == 1 and "april.enabled" in rejected[0]["errors"]
    assert [e["step"] for e in events if e["kind"] == "knob_applied"] == [1]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_000002", "step_000003"]
    from trainer import checkpoint
    _, trainer_state = checkpoint.load(tmp_path / "checkpoints" / "step_000002")
    assert len(trainer_state["rng_ranks"]) == 2
    # refused by name: async with two processes, a batch that does not split evenly
    assert "async.enabled" in r0["refused"] and "one process" in r0["refused"]["async.enabled"]
    assert "rollout.rollout_batch_size" in r1["refused"]
    # resumed on both ranks from the one checkpoint: same step, cursor and knobs, each rank's own
    # sampling RNG, one more step in lockstep on the next prompts
    assert r0["start"] == r1["start"] == (2, 8, 5e-5)
    assert r0["same_rng"] and r1["same_rng"]
    assert sorted(r0["draws"][4:] + r1["draws"][4:]) == [8, 9, 10, 11]
    for name, w in r0["resumed"].items():
        assert torch.equal(w, r1["resumed"][name]), name
    last = json.loads((tmp_path / "sink0" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 3 and last["train/samples_total"] == 48


def test_single_process_is_untouched_and_refusals_name_the_setting():
    w = distributed.World()
    assert w.all_sum(3) == 3 and w.broadcast_object([1]) == [1] and w.gather_list([2]) == [2]
    distributed.check_config(C.load("async"), 1)  # one process: everything allowed
    with pytest.raises(C.ConfigError) as e:
        distributed.check_config(C.load("all"), 2)
    assert {"async.enabled", "april.enabled", "greso.enabled"} <= set(e.value.errors)


# --- the command line under torchrun -------------------------------------------------------------

def test_torchrun_cli_two_processes(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "trainer", "run", "demo", "--out", str(out)]
    for o in TINY + ["run.max_steps=2"]:
        cmd += ["--set", o]
    env = dict(os.environ, OMP_NUM_THREADS="1", RLPILOT_DIST_TIMEOUT_S="90")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summaries = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"status"')]
    assert len(summaries) == 1 and summaries[0]["samples_total"] == 32  # printed by rank 0 only
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["dist/world_size"] == 2
    assert (out / "checkpoints" / "step_000002" / "model").is_dir()
    assert json.loads((out / "checkpoints" / "step_000002" / "state.json").read_text())["cursor"] == 8
