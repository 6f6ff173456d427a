"""Checkpoints: everything a run needs to continue exactly where it stopped.

Layout of RUN_DIR/checkpoints/step_000040/:
  model/         the policy (save_pretrained: safetensors + config + tokenizer)
  trainer.pt     optimizer state, RNG states and the components' state (torch.save)
  state.json     step, policy version, data cursor, counters, config and knob values

A checkpoint is written to a temporary folder and renamed into place, so a crash mid-write
never leaves a half checkpoint that `latest()` would pick up.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

PREFIX = "step_"


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
        engine_generator.set_state(state["engine"])


def save(run_dir: str | Path, step: int, *, model, tokenizer, state: dict[str, Any],
         tensors: dict[str, Any], keep: int = 2) -> Path:
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:06d}"
    tmp = root / f".tmp-{PREFIX}{step:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp / "model", safe_serialization=True)
    tokenizer.save_pretrained(tmp / "model")
    torch.save(tensors, tmp / "trainer.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=2, default=str) + "\n")
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


def latest(run_dir: str | Path) -> Path:
    found = list_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(f"no checkpoint in {checkpoint_root(run_dir)}")
    return found[-1]


def load(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    path = Path(path)
    state = json.loads((path / "state.json").read_text())
    tensors = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
    return state, tensors
