"""Checkpoints: everything a run needs to continue exactly where it stopped.

Layout of RUN_DIR/checkpoints/step_000040/:
  model/               the policy (save_pretrained: safetensors + config + tokenizer)
  sharded/             instead of model/'s weights, with cluster.sharding = "fsdp": the model's
                       and the optimizer's shards, one file per training rank
                       (torch.distributed.checkpoint; trainer/cluster/sharding.py)
  trainer.safetensors  every tensor of the trainer state: optimizer moments and steps, RNG states
  trainer.json         the rest of the trainer state (optimizer hyperparameters, the rollout buffer,
                       GRESO traces, Python RNG state ...) with a {"$tensor": KEY} placeholder
                       where a tensor of trainer.safetensors goes
  state.json           step, policy version, data cursor, counters, config and knob values

Loading never unpickles: safetensors holds raw tensor bytes and trainer.json is read with the
plain JSON parser; the only values it can produce are dict, list, tuple, str, int, float, bool,
None and the CPU tensors of trainer.safetensors. Loading a checkpoint cannot run code.

trainer.json is {"format": "rlpilot-trainer-state", "version": 1, "data": TREE}. TREE is JSON,
except for these one-key objects, so that the state comes back exactly as it was saved:
  {"$tensor": "optimizer/state/0/exp_avg"}  a tensor of trainer.safetensors, by its key (the
                                            tensor's path in the state, RFC 6901 escaped)
  {"$tuple": [...]}                         a tuple (random.setstate needs tuples, not lists)
  {"$dict": [[key, value], ...]}            a dict whose keys are not all strings (the optimizer
                                            state is keyed by parameter index) or that has a key
                                            starting with "$"
  {"$int": "123456789012345678901"}         an int beyond +-2**53 (exact in any JSON reader)
  {"$float": "nan" | "inf" | "-inf"}        a float JSON cannot spell
Subclasses of those types are saved as the type itself (an OrderedDict as a dict, an IntEnum
or a numpy.float64 as a number); anything else (a set, bytes, a numpy array, a dataclass, a
sparse tensor) is refused when the checkpoint is written, naming where it is in the state.
Not kept: which tensors were views of one another (each comes back on its own, on CPU).

Checkpoints written before this format (a pickled trainer.pt and no trainer.json) are loaded
with torch.load(weights_only=True): torch's restricted unpickler, which only rebuilds tensors
and plain containers and refuses any other object, so the pickle cannot run code. That is all
rlpilot ever put in trainer.pt, so those checkpoints resume unchanged (the next checkpoint is
written in the new format). A trainer.pt that holds anything else was not written by rlpilot,
or was modified, and is refused with a CheckpointError naming the file and the object; a
trainer.pt next to a trainer.json is never read. Older torch versions (< 2.6) had a known way
around weights_only (CVE-2025-32434), so with them old checkpoints are refused too, by name.

A checkpoint is written to a temporary folder and renamed into place, so a crash mid-write
never leaves a half checkpoint that `latest()` would pick up.
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file as _load_safetensors
from safetensors.torch import save_file as _save_safetensors

from trainer.models.tensors import own_storage

PREFIX = "step_"
TENSORS_FILE = "trainer.safetensors"
STATE_FILE = "trainer.json"
LEGACY_FILE = "trainer.pt"  # the pickled format written before trainer.json
FORMAT, VERSION = "rlpilot-trainer-state", 1
_SAFE_INT = 2 ** 53
_SAFE_LEGACY_TORCH = "2.6"  # first torch whose weights_only=True has no known bypass


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or loaded safely; the message names it and says why."""


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def rng_state(engine_generator: torch.Generator | None = None) -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if engine_generator is not None:
        state["engine"] = engine_generator.get_state()
    return state


def set_rng_state(state: dict[str, Any], engine_generator: torch.Generator | None = None) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if engine_generator is not None and "engine" in state:
        saved, mine = state["engine"], engine_generator.get_state()
        if saved.numel() != mine.numel() and saved.numel() % mine.numel() == 0:
            saved = saved[:mine.numel()]   # saved by several generation processes: the first's
        engine_generator.set_state(saved)


def save(run_dir: str | Path, step: int, *, model, tokenizer, state: dict[str, Any],
         tensors: dict[str, Any], keep: int = 2, write_shards=None) -> Path:
    """`write_shards(folder)`: a sharded model's writer (its DCP shards and the optimizer's go in
    folder/sharded; model/ then holds the tokenizer and the model's config, no weights)."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:06d}"
    tmp = root / f".tmp-{PREFIX}{step:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        write_trainer_state(tmp, tensors)  # first: an unsavable value fails before the model
        if write_shards is not None:
            write_shards(tmp)
            model.config.save_pretrained(tmp / "model")
        else:
            model.save_pretrained(tmp / "model", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "model")
        (tmp / "state.json").write_text(json.dumps(state, indent=2, default=str) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and p.name.startswith(PREFIX) and (p / "state.json").is_file())


def step_of(path: Path) -> int | None:
    """The step of checkpoint folder `path` (step_000040 -> 40); None for another name."""
    tail = Path(path).name[len(PREFIX):]
    return int(tail) if Path(path).name.startswith(PREFIX) and tail.isdigit() else None


def latest_step(run_dir: str | Path) -> int | None:
    """The step of the run's latest complete checkpoint; None without one."""
    found = list_checkpoints(run_dir)
    return step_of(found[-1]) if found else None


def latest(run_dir: str | Path) -> Path:
    found = list_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(f"no checkpoint in {checkpoint_root(run_dir)}")
    return found[-1]


def load(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state.json, trainer state) of the checkpoint folder `path`; tensors come back on CPU."""
    path = Path(path)
    state = json.loads((path / "state.json").read_text())
    return state, read_trainer_state(path)


# --- the trainer state: tensors in safetensors, the rest in JSON ---------------------------------
def write_trainer_state(folder: str | Path, tree: Any) -> None:
    """Write `tree` as folder/trainer.safetensors + folder/trainer.json (see the module doc)."""
    folder = Path(folder)
    data, tensors = encode(tree)
    _save_safetensors(tensors, str(folder / TENSORS_FILE), metadata={"format": "pt"})
    text = json.dumps({"format": FORMAT, "version": VERSION, "data": data},
                      allow_nan=False, separators=(",", ":"))
    (folder / STATE_FILE).write_text(text + "\n")


def read_trainer_state(folder: str | Path) -> Any:
    """The trainer state of a checkpoint folder, new format or old (trainer.pt, see the module
    doc). Raises CheckpointError, naming the file, for anything it will not load."""
    folder = Path(folder)
    if (folder / STATE_FILE).is_file():
        return _read_new(folder)
    if (folder / LEGACY_FILE).is_file():
        return _read_legacy(folder / LEGACY_FILE)
    raise FileNotFoundError(f"checkpoint {folder} has neither {STATE_FILE} nor {LEGACY_FILE}: "
                            "it is incomplete or not a checkpoint")


def _read_new(folder: Path) -> Any:
    where, tensor_path = folder / STATE_FILE, folder / TENSORS_FILE
    try:
        tensors = _load_safetensors(str(tensor_path), device="cpu") if tensor_path.is_file() else {}
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types
        raise CheckpointError(f"checkpoint {tensor_path} cannot be read: {e}") from None
    try:
        doc = decode(where.read_text(), tensors)
    except (ValueError, RecursionError) as e:  # RecursionError: nested beyond any real state
        raise CheckpointError(f"checkpoint {where} is not a valid trainer state: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "data" not in doc:
        raise CheckpointError(f"checkpoint {where} is not an rlpilot trainer state "
                              f"(no \"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise CheckpointError(f"checkpoint {where} has trainer-state version "
                              f"{doc.get('version')!r}; "
                              f"this rlpilot reads version {VERSION}: resume it with the rlpilot "
                              "that wrote it")
    return doc["data"]


def _read_legacy(where: Path) -> Any:
    from torch.torch_version import TorchVersion

    if TorchVersion(torch.__version__) < _SAFE_LEGACY_TORCH:
        raise CheckpointError(
            f"refusing to load checkpoint {where}: it is in the old pickle format (trainer.pt), "
            f"and torch {torch.__version__} cannot load a pickle without the risk of running code "
            f"in it (weights_only=True is only safe from torch {_SAFE_LEGACY_TORCH}, "
            "CVE-2025-32434). Resume it once with torch >= 2.6 (the next checkpoint is written "
            "in the new format), or resume from a newer checkpoint.")
    try:
        return torch.load(where, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- pickle.UnpicklingError, RuntimeError (bad zip) ...
        text = str(e)
        if "Weights only load failed" not in text:  # not the unpickler: a damaged zip, I/O ...
            first = text.strip().splitlines()[0] if text.strip() else ""
            raise CheckpointError(f"checkpoint {where} cannot be read ({type(e).__name__}: "
                                  f"{first}): the file is damaged or not a checkpoint") from None
        lines = [x.strip() for x in text.splitlines() if x.strip() and not x.startswith(
            ("Weights only load failed", "Please file an issue", "Check the documentation"))]
        named = [x for x in lines if "GLOBAL" in x]  # the object torch would not rebuild
        why = (f"it holds an object other than tensors and plain data, which could run code "
               f"when unpickled (torch: {named[0]}). rlpilot only ever wrote tensors and plain "
               "data there, so this file was modified or written by something else"
               if named else f"{lines[0] if lines else 'unreadable'}: the file is damaged or "
               "was not written by rlpilot")
        raise CheckpointError(
            f"refusing to load checkpoint {where}: it is in the old pickle format (trainer.pt), "
            "which is only loaded through torch's restricted unpickler (weights_only=True), "
            f"and that refused it: {why}. Resume from another checkpoint, or start a new run."
        ) from None


# --- the encoding ---------------------------------------------------------------------------------
def encode(tree: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON-able data, {key: contiguous CPU tensor}) for `tree`; see the module doc."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[tuple[int, int]] = set()
    path: list[str] = []

    def where() -> str:
        return "/".join(path) or "(top)"

    def tensor(t: torch.Tensor) -> dict[str, str]:
        if t.layout != torch.strided or t.is_quantized or t.is_meta:
            raise CheckpointError(f"cannot checkpoint the {t.layout} tensor at {where()}: "
                                  "only dense tensors are saved")
        t = own_storage(t.detach().to("cpu").contiguous(), storages)
        key = base = where()
        n = 1
        while key in tensors:  # e.g. keys 0 and "0" of one dict
            n += 1
            key = f"{base}#{n}"
        tensors[key] = t
        return {"$tensor": key}

    def enc(x: Any) -> Any:
        if x is None or x is True or x is False:
            return x
        t = type(x)
        if t is str:
            return x
        if t is int:
            return x if -_SAFE_INT <= x <= _SAFE_INT else {"$int": str(x)}
        if t is float:
            return x if math.isfinite(x) else {"$float": repr(x)}
        if t is list or t is tuple:
            if _flat(x):  # the common large case (token ids, logprobs): JSON as it is
                return x if t is list else {"$tuple": x}  # json writes a tuple as a list
            out = []
            for i, v in enumerate(x):
                path.append(str(i))
                out.append(enc(v))
                path.pop()
            return out if t is list else {"$tuple": out}
        if t is dict:
            plain = all(type(k) is str and not k.startswith("$") for k in x)
            items = []
            for k, v in x.items():
                if not _key_ok(k):
                    raise CheckpointError(f"cannot checkpoint the {type(k).__name__} key {k!r} "
                                          f"at {where()}")
                path.append(_escape(str(k)))
                items.append((k, enc(v)))
                path.pop()
            if plain:
                return dict(items)
            return {"$dict": [[enc(k), v] for k, v in items]}
        if isinstance(x, torch.Tensor):
            return tensor(x)
        # subclasses of plain types (OrderedDict, IntEnum, numpy.float64 ...) as the plain type
        for plain_type in (bool, int, float, str, list, tuple, dict):
            if isinstance(x, plain_type):
                return enc(plain_type(x) if plain_type is not dict else dict(x.items()))
        raise CheckpointError(f"cannot checkpoint the {type(x).__module__}.{type(x).__qualname__} "
                              f"at {where()}: only tensors, dict, list, tuple, str, int, float, "
                              "bool and None are saved")

    return enc(tree), tensors


def decode(text: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of encode(): parse the JSON `text` with the tags of the module doc resolved
    (`tensors`: the {key: tensor} of trainer.safetensors). Raises ValueError for anything
    encode() does not write: a tag it does not know, a key twice, NaN/Infinity literals, a
    tensor that is missing or unused."""
    used: set[str] = set()

    def obj(pairs: list[tuple[str, Any]]) -> Any:  # called bottom-up: values are decoded
        if not any(k[:1] == "$" for k, _ in pairs):
            out = dict(pairs)
            if len(out) != len(pairs):
                raise ValueError(f"duplicate key in {[k for k, _ in pairs][:10]}")
            return out
        if len(pairs) != 1:
            raise ValueError(f"a tag must be alone in its object: {[k for k, _ in pairs][:10]}")
        (name, value), = pairs
        if name == "$tensor":
            if type(value) is not str or value not in tensors:
                raise ValueError(f"{{\"$tensor\": {value!r}}} names no tensor of {TENSORS_FILE}")
            if value in used:
                raise ValueError(f"tensor {value!r} is referenced twice")
            used.add(value)
            return tensors[value]
        if name == "$tuple":
            if type(value) is not list:
                raise ValueError("\"$tuple\" needs a list")
            return tuple(value)
        if name == "$dict":
            if type(value) is not list:
                raise ValueError("\"$dict\" needs a list of [key, value] pairs")
            out = {}
            for pair in value:
                if type(pair) is not list or len(pair) != 2:
                    raise ValueError("\"$dict\" needs a list of [key, value] pairs")
                key, v = pair
                if not _key_ok(key):
                    raise ValueError(f"bad dict key {key!r}")
                if key in out:
                    raise ValueError(f"duplicate key {key!r}")
                out[key] = v
            return out
        if name == "$int":
            if type(value) is not str or not value.lstrip("-").isdigit() or not value.isascii():
                raise ValueError(f"bad \"$int\" {value!r}")
            return int(value)
        if name == "$float":
            if value not in ("nan", "inf", "-inf"):
                raise ValueError(f"bad \"$float\" {value!r}")
            return float(value)
        raise ValueError(f"unknown tag {name!r}")

    out = json.loads(text, object_pairs_hook=obj, parse_constant=_no_constant)
    if used != set(tensors):
        raise ValueError(f"{TENSORS_FILE} has tensors the state does not use: "
                         f"{sorted(set(tensors) - used)[:5]}")
    return out


def _flat(values) -> bool:
    """Whether every item is a str, None, bool, JSON-safe int or finite float."""
    for v in values:
        t = type(v)
        if t is float:
            if v - v != 0.0:  # nan or +-inf
                return False
        elif t is int:
            if not -_SAFE_INT <= v <= _SAFE_INT:
                return False
        elif t is not str and v is not None and t is not bool:
            return False
    return True


def _key_ok(key: Any) -> bool:
    if key is None or type(key) in (str, int, float, bool):
        return True
    return type(key) is tuple and all(_key_ok(k) for k in key)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (non-finite floats are written as {{\"$float\": ...}})")


def _escape(segment: str) -> str:
    return segment.replace("~", "~0").replace("/", "~1")
