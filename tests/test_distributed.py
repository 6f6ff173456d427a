"""Several training processes (trainer/cluster/distributed.py, trainer/run/training_ranks.py): two CPU
processes on the gloo backend, rank 0 the controller.

- the learner: one update split over two ranks (unevenly, and with one rank holding nothing)
  equals the single-process update on the union of the sequences; the token-balanced cut;
- the runner, in every mode (sync, APRIL, GRESO, async, all): both ranks hold the same weights,
  no prompt is drawn twice, only rank 0 reports, a knob change reaches the training rank with the
  step it applies to, the staleness bound holds; a synchronous run equals the one-process run
  (rank 0 samples what one process samples); checkpoints resume with another number of processes;
- the CLI under torchrun.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ranks import TINY, KnobsAt, digest, finish, free_port, join, rows, sequences, spawn

from trainer import config as C
from trainer.algo.learner import Learner
from trainer.cluster import distributed
from trainer.observe.metrics import JsonlSink
from trainer.run import training_ranks

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(180)


# --- the update ------------------------------------------------------------------------------------

SPLITS = [(slice(0, 9), slice(9, 12)), (slice(0, 12), slice(12, 12))]  # uneven; rank 1 empty
KW = dict(pad_id=0, lr=1e-3, grad_clip=0.5, clip_low=0.2, clip_high=0.28, kl_coef=0.1,
          micro_batch_tokens=64)


def _learner(world=None):
    from trainer.models.loading import load_model

    torch.manual_seed(0)
    model = load_model("builtin", torch.device("cpu"), torch.float32)
    return Learner(model, lr=1e-3, weight_decay=0.0, track_reference=True, dist=world)


def _updates(learner, pick):
    seqs, out = sequences(), []
    for split in SPLITS:
        metrics = learner.update(seqs[pick(split)], **KW)
        grads = {n: p.grad.clone() for n, p in learner.model.named_parameters()}
        out.append((metrics, grads))
    return out, {n: p.detach().clone() for n, p in learner.model.named_parameters()}


def _update_worker(rank, port, out_dir):
    join(rank, 2, port)
    world = distributed.init("cpu")
    assert world.size == 2 and world.backend == "gloo"
    steps, weights = _updates(_learner(world), lambda split: split[rank])
    torch.save({"steps": steps, "weights": weights}, Path(out_dir) / f"rank{rank}.pt")
    finish()


def test_update_split_over_two_ranks_equals_the_single_process_update(tmp_path):
    spawn(_update_worker, free_port(), str(tmp_path))
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


# --- the layout: rank 0 the controller, every rank trains its share --------------------------------

def test_shares_balance_tokens_longest_first():
    # longest first, each to the lighter share (ties to rank 0): 9 -> r0, 7 -> r1, 5 -> r1 (7 < 9),
    # 4 -> r0 (9 < 12), 3 -> r0 (13 > 12? no: r1 has 12, r0 13) -> r1, 1 -> r0
    assert training_ranks.shares([5, 9, 1, 7, 3, 4], 2) == [[1, 2, 5], [0, 3, 4]]
    assert training_ranks.shares([4, 4, 4], 3) == [[0], [1], [2]]
    assert training_ranks.shares([2], 3) == [[0], [], []]   # a rank may hold nothing
    cut = training_ranks.shares(list(range(1, 40)), 4)
    loads = [sum(range(1, 40)[i] for i in part) for part in cut]
    assert sorted(i for part in cut for i in part) == list(range(39))
    assert max(loads) - min(loads) <= 1
    assert training_ranks.mini_batches(list("abcdefg"), 3) == [list("adg"), list("be"), list("cf")]


MODES = {  # mode: (preset, settings that make each technique act within 3 tiny steps)
    "sync": ("demo", []),
    "april": ("april", ["april.segment_max_tokens=12"]),
    "greso": ("greso", []),
    "async": ("async", []),
    "all": ("all", ["april.segment_max_tokens=16", "async.max_inflight=8", "cluster.gen_procs=2"]),
    # LoRA adapters trained over DDP ranks, the reference the base with them off
    "lora": ("demo", ["lora.rank=4", "lora.alpha=8", "algo.track_kl=true"]),
}
LR = 5e-5


def _mode_config(mode: str, steps: int = 3):
    preset, extra = MODES[mode]
    return C.load(preset, TINY + extra + [f"run.max_steps={steps}", "run.checkpoint_every=1",
                                          "run.keep_checkpoints=5", "run.log_samples=2"])


def _mode_worker(rank, port, run_dir, mode):
    from trainer.run.runner import Runner

    join(rank, 2, port)
    run_dir = Path(run_dir)
    controls = KnobsAt(1, {"optim.lr": LR})   # read by rank 0 only
    runner = Runner(_mode_config(mode), run_dir, sink=JsonlSink(run_dir / f"sink{rank}"),
                    controls=controls, system_telemetry=False)
    controls.runner = runner
    seen, draws = [], []
    if rank == 0:
        pull, train_step = runner.prompts.next, runner.train_step

        def next_prompt():
            draw, problem = pull()
            draws.append(draw)
            return draw, problem

        def step():
            seen.append((runner.step + 1, runner.cfg.optim.lr, digest(runner.model)))
            return train_step()

        runner.prompts.next, runner.train_step = next_prompt, step
    else:
        follow_step = runner._follow_step

        def follow(step, cfg):
            seen.append((step, cfg.optim.lr, digest(runner.model)))
            follow_step(step, cfg)

        runner._follow_step = follow
    with runner:
        status = runner.run()
    torch.save({"status": status, "seen": seen, "draws": draws, "final": digest(runner.model)},
               run_dir / f"rank{rank}.pt")
    finish()


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_trains_over_two_ranks_with_one_controller(tmp_path, mode):
    spawn(_mode_worker, free_port(), str(tmp_path), mode)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["status"] == r1["status"] == "finished"
    # both ranks hold the same weights before every step and at the end, and see the same
    # config: the knob change read after step 1 is applied on both at step 2
    lr0 = C.load(MODES[mode][0]).optim.lr
    assert [s[:2] for s in r0["seen"]] == [(1, lr0), (2, LR), (3, LR)]
    assert r0["seen"] == r1["seen"] and r0["final"] == r1["final"]
    assert r0["seen"][0][2] != r0["final"]   # guard: the updates moved them
    # one data cursor: no prompt drawn twice
    assert r0["draws"] and len(r0["draws"]) == len(set(r0["draws"]))
    assert r1["draws"] == []
    # only rank 0 reports
    assert not rows(tmp_path / "sink1" / "metrics.jsonl") and not rows(tmp_path / "sink1" / "events.jsonl")
    metrics = rows(tmp_path / "sink0" / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert all(r["dist/world_size"] == 2 and r["dist/train_share_imbalance"] >= 1.0 for r in metrics)
    assert sum(r["rollout/trained_tokens"] for r in metrics) > 0
    events = rows(tmp_path / "sink0" / "events.jsonl")
    assert [e["step"] for e in events if e["kind"] == "knob_applied"] == [1]
    if mode == "april":   # the segment limit parks answers: partial rollouts happened
        assert sum(r.get("april/parked", 0) for r in metrics) > 0
    if mode in ("greso", "all"):
        assert all("greso/skip_rate" in r for r in metrics)
    if mode in ("async", "all"):   # the staleness bound over the whole system
        eta = _mode_config(mode).async_.max_staleness
        assert all(r["async/staleness/max"] <= eta for r in metrics)
        samples = rows(tmp_path / "sink0" / "samples.jsonl")
        trained = [x for x in samples if x["trained"] and x["advantage"]]
        assert trained and all(x["staleness"] <= eta for x in trained)
        assert all(x["tis_weight"] is not None for x in trained if _mode_config(mode).async_.prox_logp
                   == "recompute")   # measured on either rank, reported back to rank 0
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_000001", "step_000002", "step_000003"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "april", "greso", "lora"])
def test_a_synchronous_run_over_two_ranks_equals_the_one_process_run(tmp_path, mode):
    """Rank 0 samples exactly what one process samples, and the shared update equals the whole
    one: identical up to the first update (its float rounding may then change a sampled token)."""
    from trainer.run.runner import Runner

    spawn(_mode_worker, free_port(), str(tmp_path / "two"), mode)
    with Runner(_mode_config(mode), tmp_path / "one", sink=JsonlSink(tmp_path / "one"),
                controls=KnobsAt(1, {"optim.lr": LR}), system_telemetry=False) as runner:
        runner.controls.runner = runner
        runner.run()
    two = rows(tmp_path / "two" / "sink0" / "metrics.jsonl")
    one = rows(tmp_path / "one" / "metrics.jsonl")
    first = next((i for i, r in enumerate(one) if r["rollout/trained_tokens"]), None)
    assert first is not None, "no step trained anything: the comparison proves nothing"
    for step in range(first + 1):
        for key in ("rollout/gen_tokens", "rollout/samples", "rollout/trained_tokens", "reward/mean",
                    "april/buffer_size", "april/parked", "greso/prompts_sampled"):
            if key in one[step]:
                assert two[step][key] == one[step][key], (step, key)
    for key in ("actor/pg_loss", "actor/loss_tokens", "actor/entropy", "actor/grad_norm"):
        assert two[first][key] == pytest.approx(one[first][key], rel=1e-4, abs=1e-7), key
    ckpt = f"checkpoints/step_{first + 1:06d}/model"
    a, b = (_policy(tmp_path / run / ckpt, mode) for run in ("two", "one"))
    if mode == "lora":   # the adapters trained, the base did not
        assert all(("lora_" in n) == p.requires_grad for n, p in a.named_parameters())
        assert two[first]["actor/kl"] == pytest.approx(one[first]["actor/kl"], rel=1e-4, abs=1e-9)
    # where a weight's exact gradient is float noise (|g| ~ 1e-9), Adam's first step still moves it
    # by up to lr x sign(g), the sign being the rounding's (test_fsdp saw it in CI): a few such
    # weights may differ, by no more than two steps; every other weight is equal
    apart = total = 0
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        diff = (p - q).abs().detach()
        assert diff.max().item() <= 2 * max(LR, _mode_config(mode).optim.lr), name
        apart += int((diff > 1e-5).sum())
        total += diff.numel()
    assert apart <= total * 1e-3, f"{apart} of {total} weights differ by more than 1e-5"


def _policy(folder, mode):
    """The policy a checkpoint's model/ holds: a model, or the base with its adapters."""
    from trainer.models import lora
    from trainer.models.loading import load_model

    cpu = torch.device("cpu")
    if mode == "lora":
        return lora.load(load_model("builtin", cpu, torch.float32), folder)
    return load_model(str(folder), cpu, torch.float32)


def _resume_worker(rank, port, run_dir, steps):
    from trainer.run.runner import Runner

    join(rank, 2, port)
    run_dir = Path(run_dir)
    runner = Runner(_mode_config("all", steps), run_dir, resume=True,
                    sink=JsonlSink(run_dir / f"resumed{rank}"), system_telemetry=False)
    reference = digest(runner.learner.reference)   # the KL's reference: the base model, not the resumed policy
    with runner:
        status = runner.run()
    torch.save({"status": status, "final": digest(runner.model), "reference": reference,
                "start": getattr(runner, "prompts", None) and runner.prompts.cursor},
               run_dir / f"resumed{rank}.pt")
    finish()


@pytest.mark.slow
def test_checkpoints_resume_on_another_number_of_processes(tmp_path):
    """2 ranks + 2 generation processes -> 1 process (its engine in a thread) -> 2 ranks + 2
    generation processes, the `all` preset: each resume goes on from the last step with the
    controller's state (APRIL's buffer, GRESO, the cursor, the asynchronous queue)."""
    from trainer.run import checkpoint
    from trainer.run.runner import Runner

    spawn(_mode_worker, free_port(), str(tmp_path), "all")            # steps 1-3 on 2 ranks
    alone = _mode_config("all", steps=4)
    alone.cluster.gen_procs, alone.async_.worker = 0, "thread"
    with Runner(alone, tmp_path, resume=True, sink=JsonlSink(tmp_path / "one"),
                system_telemetry=False) as one:                         # step 4 on 1 process
        assert one.step == 3 and one.cfg.optim.lr == LR                  # the knob value resumed
        assert one.run() == "finished" and one.step == 4
    spawn(_resume_worker, free_port(), str(tmp_path), 5)               # step 5 on 2 ranks
    r0, r1 = (torch.load(tmp_path / f"resumed{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["status"] == r1["status"] == "finished" and r0["final"] == r1["final"]
    from trainer.models.loading import load_model
    base = digest(load_model("builtin", torch.device("cpu"), torch.float32))
    assert r0["reference"] == r1["reference"] == base
    assert [r["step"] for r in rows(tmp_path / "resumed0" / "metrics.jsonl")] == [5]
    state, _ = checkpoint.load(checkpoint.latest(tmp_path))
    assert state["step"] == 5 and state["config"]["cluster"]["train_procs"] == 2
    assert state["config"]["optim"]["lr"] == LR


def _failing_worker(rank, port, run_dir):
    from trainer.run.runner import Runner

    join(rank, 2, port)
    run_dir = Path(run_dir)
    runner = Runner(_mode_config("sync"), run_dir, sink=JsonlSink(run_dir / f"sink{rank}"),
                    system_telemetry=False)
    if rank == 0:   # a failure between two updates: the other rank is waiting for a message
        def broken():
            raise OSError("disk full")

        runner.save_checkpoint = broken
    try:
        runner.run()
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    runner.close()
    torch.save({"error": error, "step": runner.step}, run_dir / f"rank{rank}.pt")
    finish()


@pytest.mark.slow
def test_when_rank_0_fails_the_other_ranks_end_with_an_error_not_a_hang(tmp_path):
    spawn(_failing_worker, free_port(), str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0 == {"error": "OSError: disk full", "step": 1}
    assert r1["error"] == "RuntimeError: rank 0 (the controller) failed: its error is in its log"
    assert r1["step"] == 0   # it trained step 1: a training rank counts the steps before the one it trains


def test_a_single_process_world_is_the_identity():
    w = distributed.World()
    assert w.all_sum(3) == 3 and w.broadcast_object([1]) == [1] and w.main_only(lambda: 7) == 7
    ctl = training_ranks.Controller(w)
    seqs = sequences(5)
    assert ctl.share(seqs, C.load("demo", ["optim.mini_batches=2"]), 1, None) == [seqs[0::2], seqs[1::2]]


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
