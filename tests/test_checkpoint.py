"""Checkpoints load without unpickling: tensors in trainer.safetensors, the rest in trainer.json.
A real Runner checkpoint round-trips leaf for leaf and resumes bit for bit; an old
pickled trainer.pt loads through torch's weights_only unpickler, and one crafted to run code is
refused and runs nothing; a hostile trainer.json can only give plain data."""
import copy
import json
import math
import os
import random
import shutil

import pytest
import torch

from trainer import config as C
from trainer.models.tensors import own_storage
from trainer.observe.metrics import MemorySink
from trainer.run import checkpoint
from trainer.run.runner import Runner

# APRIL (a partial-rollout buffer in the state) and GRESO (traces and an RNG state) make the
# trainer state hold every kind of value a run writes. A checkpoint holds no KV cache: a resume is
# exact where parked samples are prefilled again at every update (recompute)
EXTRA = ["april.enabled=true", "april.segment_max_tokens=16", "rollout.max_response_len=96",
         "greso.enabled=true", "rollout.dynamic_sampling=true", "data.train_size=8",
         "engine.kv_on_update=recompute"]


def _run(run_dir, overrides, steps, **kw):
    cfg = C.load("demo", overrides + EXTRA + [f"run.max_steps={steps}"])
    runner = Runner(cfg, run_dir, sink=MemorySink(), system_telemetry=False, **kw)
    with runner:
        runner.run()
    return runner


def _weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def assert_same(a, b, path="(top)"):
    """Exactly equal, down to the type of every leaf (tuple vs list, int vs float vs bool), the
    order of dict keys, and the bits of every tensor and float (NaN and -0.0 included)."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), path
        bits = lambda t: t.detach().contiguous().flatten().view(torch.uint8)  # noqa: E731
        assert torch.equal(bits(a), bits(b)), path
    elif isinstance(a, dict):
        assert [(type(k), k) for k in a] == [(type(k), k) for k in b], path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k!r}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float):
        assert repr(a) == repr(b) and math.copysign(1, a) == math.copysign(1, b), path
    else:
        assert a == b, path


def leaf_types(tree, out=None):
    out = set() if out is None else out
    out.add(type(tree))
    if isinstance(tree, dict):
        for k, v in tree.items():
            leaf_types(k, out)
            leaf_types(v, out)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            leaf_types(v, out)
    return out


PLAIN = {dict, list, tuple, str, int, float, bool, type(None), torch.Tensor}


def _to_legacy(ckpt):
    """Rewrite a checkpoint in the legacy format (before trainer.json): torch.save of the state."""
    tree = checkpoint.read_trainer_state(ckpt)
    torch.save(tree, ckpt / "trainer.pt")
    (ckpt / "trainer.json").unlink()
    (ckpt / "trainer.safetensors").unlink()
    return tree


class RunsCode:
    """Unpickling this runs a shell command (what a malicious checkpoint would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class RunsPython:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


# --- a real Runner checkpoint ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """Two steps of the demo preset; the trainer state exactly as the runner handed it to save()."""
    from _pytest.monkeypatch import MonkeyPatch

    base = tmp_path_factory.mktemp("ckpt")
    from helpers import TINY_RUN

    saved = []
    real_save = checkpoint.save

    def save(*a, **kw):
        saved.append(copy.deepcopy(kw["tensors"]))
        return real_save(*a, **kw)

    mp = MonkeyPatch()
    mp.setattr(checkpoint, "save", save)
    try:
        runner = _run(base / "run", list(TINY_RUN), steps=2)
    finally:
        mp.undo()
    assert len(saved) == 1  # checkpoint_every=0: the one at the end
    return base, list(TINY_RUN), saved[0], _weights(runner.model), dict(runner.totals)


def test_a_runner_checkpoint_is_safetensors_and_json_and_round_trips_every_leaf(two_steps):
    base, _, saved, _, _ = two_steps
    ckpt = checkpoint.latest(base / "run")
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["model", "state.json", "trainer.json", "trainer.safetensors"]
    assert saved["rollout"]["buffer"]["groups"] and saved["greso"]["traces"]  # not trivial
    state, tree = checkpoint.load(ckpt)
    assert state["step"] == 2
    assert_same(saved, tree)
    assert leaf_types(tree) <= PLAIN
    # the shapes random.setstate and the optimizer need
    assert type(tree["rng"]["python"]) is tuple and type(tree["rng"]["python"][1]) is tuple
    assert all(type(k) is int for k in tree["optimizer"]["state"])
    assert type(tree["optimizer"]["param_groups"][0]["betas"]) is tuple
    # tensors are in the safetensors file under their path in the state; trainer.json is JSON
    from safetensors import safe_open

    with safe_open(str(ckpt / "trainer.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert {"optimizer/state/0/exp_avg", "optimizer/state/0/step", "rng/torch",
            "rng/engine"} <= keys
    doc = json.loads((ckpt / "trainer.json").read_text())
    assert doc["format"] == "rlpilot-trainer-state" and doc["version"] == 1
    assert doc["data"]["rng"]["torch"] == {"$tensor": "rng/torch"}


def test_resume_from_the_new_format_reproduces_the_uninterrupted_run(two_steps, tmp_path):
    base, tiny, _, _, _ = two_steps
    straight = _run(tmp_path / "straight", tiny, steps=4)
    shutil.copytree(base / "run", tmp_path / "resumed")
    resumed = _run(tmp_path / "resumed", tiny, steps=4, resume=True)
    assert resumed.step == 4
    assert torch.equal(_weights(straight.model), _weights(resumed.model))
    assert resumed.totals == straight.totals
    assert resumed.greso.state_dict() == straight.greso.state_dict()
    # the APRIL buffer too, but for request ids (a process-wide counter: unique, not replayed)
    assert _no_ids(resumed.rollout.state_dict()) == _no_ids(straight.rollout.state_dict())


def test_a_resume_with_kept_caches_rebuilds_them_and_says_so(two_steps, tmp_path):
    """engine.kv_on_update = keep: the checkpoint's parked samples have no cache in the resumed
    run; they are prefilled under the resumed weights, and the resume event says so."""
    base, tiny, _, _, _ = two_steps
    shutil.copytree(base / "run", tmp_path / "resumed")
    cfg = C.load("demo", tiny + EXTRA + ["engine.kv_on_update=keep", "run.max_steps=3"])
    sink = MemorySink()
    with Runner(cfg, tmp_path / "resumed", sink=sink, system_telemetry=False, resume=True,
                keep_knobs=("engine.kv_on_update",)) as runner:
        runner.run()
    assert runner.step == 3
    event = next(e for e in sink.events if e["kind"] == "run_resumed")
    assert "prefilled again under the resumed weights" in event["kv_cache"]
    assert "keep" in event["kv_cache"]
    # the buffer's samples had tokens: their histories were prefilled again, no cache was kept
    assert sink.steps[-1]["engine/resumed_prefill_tokens"] > 0


def _no_ids(rollout_state):
    for g in rollout_state["buffer"]["groups"]:
        for s in g["samples"]:
            s.pop("request_id")
    return rollout_state


# --- checkpoints written before the change ------------------------------------------------------
def test_an_old_trainer_pt_checkpoint_loads_safely_and_resumes_exactly(two_steps, tmp_path):
    base, tiny, saved, _, _ = two_steps
    shutil.copytree(base / "run", tmp_path / "old")
    ckpt = checkpoint.latest(tmp_path / "old")
    _to_legacy(ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == ["model", "state.json", "trainer.pt"]
    _, tree = checkpoint.load(ckpt)  # torch.load(weights_only=True)
    assert_same(saved, tree)
    straight = _run(tmp_path / "straight", tiny, steps=4)
    resumed = _run(tmp_path / "old", tiny, steps=4, resume=True)
    assert torch.equal(_weights(straight.model), _weights(resumed.model))
    assert resumed.totals == straight.totals
    # ... and its next checkpoint is in the new format
    assert (checkpoint.latest(tmp_path / "old") / "trainer.json").is_file()


@pytest.mark.parametrize("payload", [RunsCode, RunsPython])
def test_an_old_checkpoint_crafted_to_run_code_is_refused_and_runs_nothing(
        two_steps, tmp_path, payload):
    base, tiny, _, _, _ = two_steps
    shutil.copytree(base / "run", tmp_path / "evil")
    ckpt = checkpoint.latest(tmp_path / "evil")
    tree = _to_legacy(ckpt)
    marker = tmp_path / "pwned"
    tree["rollout"]["buffer"]["groups"][0]["samples"][0]["meta"]["x"] = payload(marker)
    torch.save(tree, ckpt / "trainer.pt")
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load(ckpt)
    msg = str(e.value)
    assert str(ckpt / "trainer.pt") in msg and "refusing" in msg and "run code" in msg
    assert not marker.exists()
    with pytest.raises(checkpoint.CheckpointError):  # the resume path is the same load
        Runner(C.load("demo", tiny + EXTRA + ["run.max_steps=3"]), tmp_path / "evil",
               sink=MemorySink(), system_telemetry=False, resume=True)
    assert not marker.exists()


def test_a_trainer_pt_next_to_trainer_json_is_never_read(two_steps, tmp_path):
    base, _, saved, _, _ = two_steps
    shutil.copytree(base / "run", tmp_path / "both")
    ckpt = checkpoint.latest(tmp_path / "both")
    marker = tmp_path / "pwned"
    torch.save({"x": RunsCode(marker)}, ckpt / "trainer.pt")
    _, tree = checkpoint.load(ckpt)
    assert_same(saved, tree)
    assert not marker.exists()


def test_an_unreadable_old_checkpoint_is_named(tmp_path):
    (tmp_path / "state.json").write_text("{}")
    (tmp_path / "trainer.pt").write_bytes(b"not a zip")
    with pytest.raises(checkpoint.CheckpointError, match="damaged") as e:
        checkpoint.load(tmp_path)
    assert str(tmp_path / "trainer.pt") in str(e.value)
    (tmp_path / "trainer.pt").write_bytes(b"PK\x03\x04 a broken zip")
    with pytest.raises(checkpoint.CheckpointError, match="damaged") as e:
        checkpoint.load(tmp_path)
    assert str(tmp_path / "trainer.pt") in str(e.value)
    (tmp_path / "trainer.pt").unlink()
    with pytest.raises(FileNotFoundError, match="neither trainer.json nor trainer.pt"):
        checkpoint.load(tmp_path)


def test_old_checkpoints_are_refused_on_a_torch_whose_weights_only_is_unsafe(tmp_path, monkeypatch):
    torch.save({"a": 1}, tmp_path / "trainer.pt")
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    with pytest.raises(checkpoint.CheckpointError, match="CVE-2025-32434") as e:
        checkpoint.read_trainer_state(tmp_path)
    assert str(tmp_path / "trainer.pt") in str(e.value)


# --- the encoding ---------------------------------------------------------------------------------
def test_every_kind_of_value_round_trips_exactly(tmp_path):
    gen = torch.Generator().manual_seed(7)
    random.seed(5)
    base = torch.arange(12, dtype=torch.float32)
    tree = {
        "ints": [0, -1, 2**53, 2**53 + 1, -(2**53) - 1, 2**64 + 3, -(2**100)],
        "floats": [0.1, -0.0, 1e-320, 1.7976931348623157e308, float("nan"), float("inf"),
                   float("-inf")],
        "odd": [None, True, False, 1, 1.0, "", "$tensor", "~/x"],
        "nesting": ([], (), {}, [()], ((1, [2, (3,)]),)),
        "int keys": {0: "a", "0": "b", 1: {2: [3]}},
        "other keys": {None: 1, True: 2, 2.5: 3, (1, "a", (2,)): 4},
        "tag keys": {"$tensor": {"$tuple": [1, 2]}, "$x": "y"},  # keys like tags stay keys
        "a/b": {"~": torch.ones(2)},     # path-like tensor keys are escaped
        "python_rng": random.getstate(),
        "tensors": [torch.tensor(3.5), torch.zeros(0, 3), torch.tensor([True, False]),
                    torch.arange(5, dtype=torch.int64), torch.rand(2, 3).to(torch.bfloat16),
                    torch.tensor([float("nan"), -0.0]), gen.get_state(),
                    base[2:5], base.view(3, 4).t(), base],  # views, shared storage
        "shared": [base, base],
    }
    checkpoint.write_trainer_state(tmp_path, tree)
    back = checkpoint.read_trainer_state(tmp_path)
    assert_same(tree, back)
    assert leaf_types(back) <= PLAIN
    random.setstate(back["python_rng"])  # usable as it is
    first = random.random()
    random.seed(5)
    assert first == random.random()
    # with no "$" key and only str keys a dict is a plain JSON object: the file stays readable
    doc = json.loads((tmp_path / "trainer.json").read_text())
    assert doc["data"]["odd"] == [None, True, False, 1, 1.0, "", "$tensor", "~/x"]
    assert doc["data"]["ints"][2] == 2**53 and doc["data"]["ints"][3] == {"$int": str(2**53 + 1)}


@pytest.mark.parametrize("value, where", [
    (object(), "rollout/0/x"),
    (torch.ones(2).to_sparse(), "rollout/0/x"),
    ({1, 2}, "rollout/0/x"),
    (b"bytes", "rollout/0/x"),
])
def test_values_that_are_not_plain_data_are_refused_when_written(tmp_path, value, where):
    with pytest.raises(checkpoint.CheckpointError, match="cannot checkpoint") as e:
        checkpoint.write_trainer_state(tmp_path, {"rollout": [{"x": value}]})
    assert where in str(e.value)


def test_a_failed_save_leaves_no_checkpoint_and_no_temporary_folder(tmp_path):
    class Unused:
        def save_pretrained(self, *a, **kw):
            raise AssertionError("not reached")

    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.save(tmp_path, 1, model=Unused(), tokenizer=Unused(), state={},
                        tensors={"x": object()})
    assert list(checkpoint.checkpoint_root(tmp_path).iterdir()) == []


# --- a hostile trainer.json -----------------------------------------------------------------------
def _write(tmp_path, data, tensors=None, version=1):
    from safetensors.torch import save_file

    save_file(tensors or {}, str(tmp_path / "trainer.safetensors"))
    (tmp_path / "trainer.json").write_text(
        data if isinstance(data, str) else
        json.dumps({"format": "rlpilot-trainer-state", "version": version, "data": data}))
    return tmp_path


T = {"t": torch.ones(1)}


@pytest.mark.parametrize("data, tensors, reason", [
    ({"x": {"$class": "os.system"}}, None, "unknown tag"),
    ({"x": {"$tuple": [1], "__reduce__": "os.system"}}, None, "alone in its object"),
    ({"x": {"$tensor": "missing"}}, T, "names no tensor"),
    ({"x": {"$tensor": ["t"]}}, T, "names no tensor"),
    ({"x": {"$tensor": "t"}, "y": {"$tensor": "t"}}, T, "referenced twice"),
    ({"x": {"$dict": [[[1, 2], 3]]}}, None, "bad dict key"),          # unhashable
    ({"x": {"$dict": [[{"$tensor": "t"}, 3]]}}, T, "bad dict key"),   # a tensor as a key
    ({"x": {"$dict": [[1, 2, 3]]}}, None, "pairs"),
    ({"x": {"$dict": [[1, 2], [1, 3]]}}, None, "duplicate key"),
    ({"x": {"$int": "1e9"}}, None, "bad"),
    ({"x": {"$int": "0x10"}}, None, "bad"),
    ({"x": {"$float": "1.5"}}, None, "bad"),
    ({"x": {"$tuple": "abc"}}, None, "needs a list"),
    ({"x": 1}, T, "does not use"),
    ('{"format": "rlpilot-trainer-state", "version": 1, "data": {"x": NaN}}', None, "NaN"),
    ('{"format": "rlpilot-trainer-state", "version": 1, "data": {"x": 1, "x": 2}}', None,
     "duplicate key"),
    ('{"format": "rlpilot-trainer-state", "version": 1, "data": ', None, "Expecting value"),
])
def test_a_hostile_trainer_json_is_refused(tmp_path, data, tensors, reason):
    _write(tmp_path, data, tensors)
    with pytest.raises(checkpoint.CheckpointError, match=reason) as e:
        checkpoint.read_trainer_state(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_a_trainer_json_can_only_give_plain_data(tmp_path):
    # keys a pickle or a class-hinting decoder would act on are just strings here
    data = {"__reduce__": ["os.system", ["touch x"]], "py/object": "os.system",
            "__class__": {"__module__": "os", "__name__": "system"}, "t": {"$tensor": "t"},
            "d": {"$dict": [[{"$tuple": [1, "a"]}, {"$tuple": []}], [None, [1.5]]]}}
    _write(tmp_path, data, {"t": torch.ones(2, dtype=torch.int32)})
    back = checkpoint.read_trainer_state(tmp_path)
    assert leaf_types(back) <= PLAIN
    assert back["__reduce__"] == ["os.system", ["touch x"]]
    assert back["d"] == {(1, "a"): (), None: [1.5]}
    assert torch.equal(back["t"], torch.ones(2, dtype=torch.int32))


def test_foreign_or_newer_trainer_states_and_stray_tensors_are_refused(tmp_path):
    _write(tmp_path, {"x": 1}, version=2)
    with pytest.raises(checkpoint.CheckpointError, match="version 2"):
        checkpoint.read_trainer_state(tmp_path)
    _write(tmp_path, '{"format": "other", "data": {}}')
    with pytest.raises(checkpoint.CheckpointError, match="not an rlpilot trainer state"):
        checkpoint.read_trainer_state(tmp_path)
    _write(tmp_path, {"x": 1}, {"stray": torch.ones(1)})
    with pytest.raises(checkpoint.CheckpointError, match="stray"):
        checkpoint.read_trainer_state(tmp_path)
    (tmp_path / "trainer.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(checkpoint.CheckpointError, match="trainer.safetensors"):
        checkpoint.read_trainer_state(tmp_path)


def test_own_storage_gives_each_written_tensor_memory_of_its_own():
    """The one rule both safetensors writers follow (checkpoints, the SGLang engine's weights)."""
    base = torch.arange(6.0)
    seen: set = set()
    first = own_storage(base, seen)
    same = own_storage(base.view(2, 3), seen)    # the same storage again
    part = own_storage(torch.arange(4.0)[:2], set())   # a view of a larger one
    empty = own_storage(torch.zeros(0), seen)
    assert first is base
    assert same.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert torch.equal(same, base.view(2, 3)) and torch.equal(part, torch.arange(2.0))
    assert part.untyped_storage().nbytes() == part.nbytes
    assert empty.numel() == 0 and len(seen) == 2


def test_sglang_weights_with_shared_storage_are_written_apart(tmp_path):
    from safetensors.torch import load_file

    from trainer.engine.sglang import SGLangEngine

    w = torch.arange(6.0)
    eng = SGLangEngine("http://127.0.0.1:9", weights_dir=tmp_path, check_health=False)
    try:
        folder = eng._save_weights({"a": w, "b": w.view(2, 3), "c": w[:3]}, 1)
    finally:
        eng.close()
    back = load_file(str(folder / "model.safetensors"))
    assert torch.equal(back["a"], w) and torch.equal(back["b"], w.view(2, 3))
    assert torch.equal(back["c"], w[:3])
