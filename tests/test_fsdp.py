"""Sharded training ranks (`cluster.sharding = "fsdp"`: trainer/cluster/sharding.py): two CPU processes
on gloo, each holding half of every weight, gradient and Adam moment.

- the learner: a sharded update (uneven shares, one rank holding nothing, so one rank runs empty
  micro-batches to keep the collectives matched) equals the one-process update; log-probabilities
  computed on shares of different sizes equal one process's;
- the runner: every update of a sharded run, replayed in one process from the previous checkpoint
  (read back whole from the DCP shards), gives the same log-probs, metrics and weights; the `all` preset (asynchronous,
  APRIL, GRESO, the reference's KL, recomputed log-probs shared out) runs and takes a knob
  change; its sharded checkpoints resume on one process and back on two sharded ranks;
- LoRA: the adapters train sharded as in one process (the base bit-identical), an update
  gathers only the factors, the checkpoints hold the adapters alone; export and resume on one
  process and back read them;
- the config refuses a sharded run whose engine lives in rank 0;
- on CUDA (NCCL) the same sharded update, skipped without two GPUs.
"""
import dataclasses
from pathlib import Path

import pytest
import torch
from ranks import TINY, KnobsAt, finish, free_port, join, rows, sequences, spawn

from trainer import config as C
from trainer.algo.learner import Learner
from trainer.cluster import distributed, sharding
from trainer.observe.metrics import JsonlSink

pytestmark = pytest.mark.timeout(300)
SPLITS = [(slice(0, 9), slice(9, 12)), (slice(0, 12), slice(12, 12))]  # uneven; rank 1 empty
KW = dict(pad_id=0, lr=1e-3, grad_clip=0.5, clip_low=0.2, clip_high=0.28, kl_coef=0.1,
          micro_batch_tokens=64)


LORA = ["lora.rank=4", "lora.alpha=8"]


def _model(device="cpu", adapted=False):
    """The built-in model, with the same fresh adapters in every process when `adapted`."""
    from trainer.models import lora
    from trainer.models.loading import load_model

    torch.manual_seed(0)
    model = load_model("builtin", torch.device(device), torch.float32)
    return lora.wrap(model, C.load("demo", LORA)) if adapted else model


def _learner(world=None, device="cpu", adapted=False):
    return Learner(_model(device, adapted), lr=1e-3, weight_decay=0.0, track_reference=True,
                   dist=world, sharded=world is not None)


def _run_updates(learner, pick):
    seqs, out, live = sequences(), [], {}
    for split in SPLITS:
        out.append(learner.update(seqs[pick(split)], **KW))
        if not learner.sharded:   # where the exact gradient is not zero (see below)
            for n, p in learner.model.named_parameters():
                if p.grad is not None:   # LoRA's frozen base has none
                    live[n] = live.get(n, False) | (p.grad.abs() > 1e-6).cpu()
    logprobs = learner.logprobs(seqs[pick(SPLITS[1])], 0, 64)
    return out, logprobs, {k: v.cpu() for k, v in learner.full_state_dict().items()}, live


def _update_worker(rank, port, out_dir, device):
    join(rank, 2, port)
    world = distributed.init(device)
    learner = _learner(world, device)
    # guard: every rank holds a shard, not the whole model
    assert all(hasattr(p, "to_local") for p in learner.model.parameters())
    steps, logprobs, weights, _ = _run_updates(learner, lambda split: split[rank])
    torch.save({"steps": steps, "logprobs": logprobs, "weights": weights}, Path(out_dir) / f"rank{rank}.pt")
    finish()


def _check_sharded_update_equals_one_process(tmp_path, device):
    spawn(_update_worker, free_port(), str(tmp_path), device)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    single = _learner(device=device)
    single_steps, single_logprobs, single_weights, live = _run_updates(single, lambda split: slice(0, 12))
    assert r1["weights"] == {}   # the whole weights land on rank 0 only
    assert r0["steps"] == r1["steps"]
    for m, ms in zip(r0["steps"], single_steps):
        for key in ("actor/loss_tokens", "actor/pg_loss", "actor/kl", "actor/entropy", "actor/grad_norm"):
            assert m[key] == pytest.approx(ms[key], rel=1e-4, abs=1e-7), key
    # compared where there is a gradient: Adam's first steps move a weight by about lr x sign(grad),
    # so where the exact gradient is zero (k_proj.bias: softmax ignores a bias shared by all keys)
    # float noise alone picks the direction, in both runs
    moved = 0
    for name, w in single_weights.items():
        if name not in live:   # a tied alias (lm_head = the embedding), compared under its own name
            continue
        torch.testing.assert_close(r0["weights"][name][live[name]], w.cpu()[live[name]], rtol=0, atol=5e-6,
                                   msg=name)
        moved += int((w.cpu() != _learner().model.state_dict()[name]).any())
    assert moved > len(single_weights) // 2   # guard: the updates moved the weights
    # rank 0 held every sequence of SPLITS[1], rank 1 none: its forwards were empty ones
    for got, want in zip(r0["logprobs"], single_logprobs):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-5)   # after two updates: their rounding
    assert r1["logprobs"] == []


def test_sharded_update_equals_the_one_process_update(tmp_path):
    _check_sharded_update_equals_one_process(tmp_path, "cpu")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL sharding needs two CUDA devices")
def test_sharded_update_on_two_gpus_equals_the_one_process_update(tmp_path):
    _check_sharded_update_equals_one_process(tmp_path, "cuda")


def _lora_update_worker(rank, port, out_dir):
    join(rank, 2, port)
    learner = _learner(distributed.init("cpu"), adapted=True)
    assert all(hasattr(p, "to_local") for p in learner.model.parameters())   # guard: sharded
    steps, logprobs, merged, _ = _run_updates(learner, lambda split: split[rank])
    torch.save({"steps": steps, "logprobs": logprobs, "merged": merged,
                "factors": learner.full_state_dict(only_changed=True)}, Path(out_dir) / f"rank{rank}.pt")
    finish()


def test_sharded_lora_update_equals_the_one_process_update(tmp_path):
    """The adapters trained over two sharded ranks (the reference: the base with them off)
    equal one process's; the base stays bit-identical; an update gathers the factors alone."""
    from trainer.models.lora import LORA_A, LORA_B

    spawn(_lora_update_worker, free_port(), str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r1["merged"] == r1["factors"] == {}   # whole on rank 0 only
    single = _learner(adapted=True)
    steps, logprobs, merged, _ = _run_updates(single, lambda split: slice(0, 12))
    for m, ms in zip(r0["steps"], steps):
        for key in ("actor/loss_tokens", "actor/pg_loss", "actor/kl", "actor/entropy", "actor/grad_norm"):
            assert m[key] == pytest.approx(ms[key], rel=1e-4, abs=1e-7), key
    assert steps[1]["actor/kl"] > 0   # guard: the adapters moved the policy off the reference
    factors = single.full_state_dict(only_changed=True)
    assert factors.keys() == r0["factors"].keys()
    assert all(factors[n].abs().max() > 0 for n in factors if n.endswith(LORA_B))   # B left zero
    for name, t in factors.items():
        torch.testing.assert_close(r0["factors"][name], t, rtol=0, atol=5e-6, msg=name)
    base = _model().state_dict()
    adapted = {n.removesuffix(LORA_A) for n in factors if n.endswith(LORA_A)}
    for name, w in merged.items():
        torch.testing.assert_close(r0["merged"][name], w, rtol=0, atol=5e-6, msg=name)
        if name not in adapted:
            assert torch.equal(r0["merged"][name], base[name]), name   # the frozen rest
    nbytes = [sum(t.numel() * t.element_size() for t in d.values()) for d in (factors, merged)]
    assert nbytes[0] * 10 < nbytes[1]   # an update the adapters' size, not the model's
    for got, want in zip(r0["logprobs"], logprobs):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-5)


# --- the runner ------------------------------------------------------------------------------------

SHARDED = ["cluster.sharding=fsdp", "cluster.gen_procs=1"]
LR = 5e-5


def _config(preset: str, steps: int, extra=()):
    return C.load(preset, TINY + SHARDED + [f"run.max_steps={steps}", "run.checkpoint_every=1",
                                            "run.keep_checkpoints=5", *extra])


def _run_worker(rank, port, run_dir, preset, steps, extra, resume, knob=True):
    from trainer.run.controls import ControlSource
    from trainer.run.runner import Runner

    join(rank, 2, port)
    run_dir = Path(run_dir)
    controls = KnobsAt(1, {"optim.lr": LR}) if knob else ControlSource()
    runner = Runner(_config(preset, steps, extra), run_dir, sink=JsonlSink(run_dir / f"sink{rank}"),
                    controls=controls, resume=resume, system_telemetry=False)
    controls.runner = runner
    lrs, batches = [], []
    if rank == 0:   # every update's whole batch, as rank 0 shares it out
        share = runner.ranks.share

        def recorded(seqs, cfg, step, decoupled_loss):
            if seqs:
                batches.append((step, [dataclasses.replace(s, report=None) for s in seqs]))
            return share(seqs, cfg, step, decoupled_loss)

        runner.ranks.share = recorded
    if rank > 0:
        follow_step = runner._follow_step

        def follow(step, cfg):
            lrs.append((step, cfg.optim.lr))
            follow_step(step, cfg)

        runner._follow_step = follow
    with runner:
        status = runner.run()
    torch.save({"status": status, "lrs": lrs}, run_dir / f"rank{rank}.pt")
    if rank == 0:
        torch.save(batches, run_dir / "batches.pt")
    finish()


def _shard_contents(checkpoint_dir: Path) -> dict[str, dict[str, int]]:
    """What a checkpoint's DCP shards hold: {"model"|"optim": {tensor name: elements}}."""
    import math

    from torch.distributed.checkpoint import FileSystemReader

    out: dict[str, dict[str, int]] = {"model": {}, "optim": {}}
    for key, meta in FileSystemReader(checkpoint_dir / sharding.SHARDED_DIR).read_metadata() \
            .state_dict_metadata.items():
        part, _, name = key.partition(".")
        if hasattr(meta, "size"):
            out[part][name] = math.prod(meta.size)
    return out


def _whole(checkpoint_dir: Path, adapted=False):
    """The policy of a checkpoint: the model folder's weights, or the shards read whole."""
    from trainer.models import lora
    from trainer.models.loading import load_model

    if sharding.is_sharded(checkpoint_dir):
        model = _model(adapted=adapted)
        sharding.read_whole(checkpoint_dir, model)
        return model
    if adapted:
        return lora.load(_model(), checkpoint_dir / "model")
    return load_model(str(checkpoint_dir / "model"), torch.device("cpu"), torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("adapted", [False, True], ids=["full", "lora"])
def test_a_sharded_runs_updates_equal_one_process_updates_on_the_same_batches(tmp_path, adapted):
    """Each step of a sharded run (log-probs recomputed by shared-out forwards, the reference's
    KL tracked) replayed in one process from the previous checkpoint: the same recomputed
    log-probs, the same metrics, the same weights. (One process's own run is no reference: the
    generation process's sampling depends on when requests reach it.) LoRA: the base is never
    touched, the checkpoints' shards and the weight updates are the adapters' size."""
    from trainer.models import lora

    extra = ["algo.recompute_old_logprobs=true", "algo.track_kl=true", "run.max_steps=3",
             *(LORA if adapted else [])]
    spawn(_run_worker, free_port(), str(tmp_path), "demo", 3, extra, False, False)
    batches = torch.load(tmp_path / "batches.pt", weights_only=False)
    metrics = rows(tmp_path / "sink0" / "metrics.jsonl")
    cfg = _config("demo", 3, extra)
    trained = compared = total = 0
    for step, seqs in batches:
        before = tmp_path / "checkpoints" / f"step_{step - 1:06d}"
        single = _learner(adapted=adapted)
        if step > 1:
            single.optimizer.load_state_dict(sharding.read_whole(before, single.model))
        for seq, want in zip(seqs, single.logprobs(seqs, 0, cfg.optim.micro_batch_tokens)):
            assert seq.old_logprobs == pytest.approx(want, rel=1e-5, abs=1e-5)
        got = single.train(seqs, cfg, 0, [], None)
        row = metrics[step - 1]
        for key in ("actor/pg_loss", "actor/loss_tokens", "actor/entropy", "actor/grad_norm", "actor/kl"):
            assert row[key] == pytest.approx(got[key], rel=1e-4, abs=1e-6), (step, key)
        after = _whole(tmp_path / "checkpoints" / f"step_{step:06d}", adapted)
        for (name, p), (_, q) in zip(after.named_parameters(), single.model.named_parameters()):
            if q.grad is None:   # LoRA's frozen base
                assert torch.equal(p, q), name
                continue
            # equal where the gradient is above float noise; where it is noise (|g| ~ 1e-9), Adam
            # still moves the weight by about lr x sign(g), and the sign is the rounding's
            # (CI saw 1.5e-5 apart at |g| = 1.5e-9): there only bounded by the step size
            live = q.grad.abs() > 1e-6
            torch.testing.assert_close(p.detach()[live], q.detach()[live], rtol=0, atol=1e-5, msg=name)
            assert (p - q).abs().max().item() <= 2 * cfg.optim.lr, name
            compared += int(live.sum())
            total += live.numel()
        trained += len(seqs)
    assert trained, "no step trained anything: the comparison proves nothing"
    assert compared > total // 2, "most weights compared only by the step-size bound: the check proves little"
    assert all(sharding.is_sharded(tmp_path / "checkpoints" / f"step_{k:06d}") for k in (1, 2, 3))
    assert not (tmp_path / "checkpoints" / "step_000001" / "model" / "model.safetensors").exists()
    if adapted:
        factors = sum(t.numel() * t.element_size()
                      for t in single.full_state_dict(only_changed=True).values())
        assert all(r["perf/weight_sync_bytes"] == factors for r in metrics)
        held = _shard_contents(tmp_path / "checkpoints" / "step_000003")
        assert held["model"] and all(lora.is_factor(k) for k in held["model"])   # not the base
        assert sum(held["model"].values()) * 4 == factors


@pytest.mark.slow
@pytest.mark.parametrize("adapted", [False, True], ids=["full", "lora"])
def test_the_all_preset_sharded_and_its_checkpoints_on_other_layouts(tmp_path, adapted):
    """2 sharded ranks (steps 1-2) -> 1 process, thread engine (step 3) -> 2 sharded ranks (4).
    LoRA: the sharded checkpoint (adapters alone) exported as PEFT's adapter and merged."""
    from trainer.run.runner import Runner

    extra = ["april.segment_max_tokens=16", "async.max_inflight=8", "algo.track_kl=true",
             "async.prox_logp=recompute", *(LORA if adapted else [])]
    spawn(_run_worker, free_port(), str(tmp_path), "all", 2, extra, False)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["status"] == r1["status"] == "finished"
    lr0 = C.load("all").optim.lr
    assert r1["lrs"] == [(1, lr0), (2, LR)]   # the knob change reached the sharded rank at step 2
    metrics = rows(tmp_path / "sink0" / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [1, 2] and sum(r["rollout/trained_tokens"] for r in metrics) > 0
    eta = _config("all", 2, extra).async_.max_staleness
    assert all(r["async/staleness/max"] <= eta for r in metrics)
    assert all(r["perf/weight_sync_bytes"] > 0 for r in metrics)   # the whole weights reached the generator
    step2 = tmp_path / "checkpoints" / "step_000002"
    assert sharding.is_sharded(step2)
    sharded_policy = _whole(step2, adapted)
    if adapted:
        _check_exports(tmp_path, sharded_policy)

    alone = _config("all", 3, extra)
    alone.cluster.gen_procs, alone.async_.worker, alone.cluster.train_procs = 0, "thread", 1
    with Runner(alone, tmp_path, resume=True, sink=JsonlSink(tmp_path / "one"), system_telemetry=False) as one:
        assert one.step == 2 and one.cfg.optim.lr == LR
        for (name, p), (_, q) in zip(one.model.named_parameters(), sharded_policy.named_parameters()):
            assert torch.equal(p, q), name   # the shards read whole, exactly
        assert one.learner.optimizer.state   # and the Adam moments with them
        assert one.run() == "finished" and one.step == 3
    weights = "adapter_model.safetensors" if adapted else "model.safetensors"
    assert (tmp_path / "checkpoints" / "step_000003" / "model" / weights).is_file()

    spawn(_run_worker, free_port(), str(tmp_path), "all", 4, extra, True)   # unsharded -> sharded
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert r0["status"] == "finished"
    resumed = rows(tmp_path / "sink0" / "metrics.jsonl")
    assert [r["step"] for r in resumed][-1] == 4
    assert sharding.is_sharded(tmp_path / "checkpoints" / "step_000004")


def _check_exports(run_dir: Path, policy) -> None:
    """`export --adapter` and `--merged` of a sharded LoRA checkpoint: what PEFT and
    transformers load from them is the policy the shards hold."""
    from peft import PeftModel

    from trainer.cli.export import export
    from trainer.models import lora
    from trainer.models.loading import load_model

    export(run_dir, run_dir / "adapter", adapter=True, step=2)
    export(run_dir, run_dir / "merged", adapter=False, step=2)
    reloaded = PeftModel.from_pretrained(_model(), str(run_dir / "adapter"), is_trainable=False)
    merged = load_model(str(run_dir / "merged"), torch.device("cpu"), torch.float32).state_dict()
    for name, t in lora.merged_weights(policy).items():
        assert torch.equal(merged[name], t), name
    for name, t in lora.adapter_weights(policy).items():
        assert torch.equal(lora.adapter_weights(reloaded)[name], t), name
    assert any(t.abs().max() > 0 for n, t in lora.adapter_weights(policy).items() if "lora_B" in n)


def test_sharding_with_the_engine_in_rank_0_is_refused_by_name():
    with pytest.raises(C.ConfigError) as e:
        C.load("demo", ["cluster.sharding=fsdp", "cluster.train_procs=2"])
    assert "cluster.sharding" in e.value.errors and "gen_procs" in e.value.errors["cluster.sharding"]
    C.load("demo", ["cluster.sharding=fsdp", "cluster.train_procs=2", "cluster.gen_procs=1"])
    C.load("demo", ["cluster.sharding=fsdp"])   # one process: nothing to shard, nothing refused
