"""Publishing new weights to the SGLang servers (a mixin of `SGLangEngine`).

`update_weights()` on every server: `/pause_generation` (mode "abort": requests in flight come
back with what they generated so far), the new weights with `weight_version`, `/flush_cache`,
`/continue_generation`. The weights travel one of two ways (`weight_sync`):
"distributed": a torch.distributed group of this process (rank 0) and the servers, built once
with `/init_weights_update_group` (trainer/engine/weight_group.py), then per update
`/begin_weight_update`, `/update_weights_from_distributed` while this process broadcasts each
tensor, `/end_weight_update` -- no file; "disk": a `save_pretrained`-style directory
(safetensors + config.json) under `weights_dir` and `/update_weights_from_disk`. A group that
cannot be built or fails an update (a server gone) becomes a warning and the disk path from
then on. The interrupted samples are resubmitted by the engine itself, so every token keeps the
version of the weights that produced it (the embedded engine's `recompute_kv=True` behaviour;
`recompute_kv` is ignored). `last_sync_bytes`: what the last update moved. The tensors travel
in the servers' dtype when they share one (trainer/engine/sglang/precision.py).

Weights folders: every `vNNNNNN` folder it writes holds a `.rlpilot-weights` marker, and it
replaces or prunes only folders with that marker (never a folder someone else put there).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

from trainer.engine.base import EngineError
from trainer.engine.sglang.transport import DOWN, Server, snippet

log = logging.getLogger(__name__)
WEIGHTS_MARKER = ".rlpilot-weights"   # in every weights folder this engine wrote


class WeightPublisher:
    """`update_weights` and what it takes: the weight group, the weights folders (a mixin of
    SGLangEngine, whose servers, lock and calls it uses)."""

    def update_weights(self, named_tensors, version: int, recompute_kv: bool = False) -> None:
        """Pause -> the new weights (broadcast, or from disk) -> flush -> continue on every
        server. Calls in flight are interrupted and resubmitted under the new weights, so their
        tokens keep exact versions (`recompute_kv` is implied)."""
        with self.lock:
            self._check_open()
            tensors = self._tensors_to_send(named_tensors)
            # a host copy of this version for a server that rejoins when none holds it: the
            # trainer's own tensors change with its next update, maybe while that happens
            self._last_tensors = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}
            for t in self._tickets.values():
                t.update_abort = True
            paused: list[Server] = []
            ok = False
            try:
                for srv in self._live_servers():
                    if self._control(srv, "POST", "/pause_generation", {"mode": "abort"}) is not DOWN:
                        paused.append(srv)
                servers = self._live_servers()
                if servers:
                    self._publish(tensors, version, servers,
                                  broadcast=self.weight_sync == "distributed")
                for srv in self._live_servers():
                    srv.stale = False
                self._published.add(int(version))
                self.version = version
                for srv in self._live_servers():
                    try:
                        self._call(srv, "POST", "/flush_cache", retry=False)
                    except EngineError as e:  # busy servers may refuse; the update flushed anyway
                        self._warn(str(e))
                ok = True
            finally:
                errors = []
                for srv in paused:  # never leave a server paused, even when the update failed
                    try:
                        if not srv.down:
                            self._control(srv, "POST", "/continue_generation", {})
                    except EngineError as e:
                        errors.append(e)
                if ok and errors:
                    raise errors[0]
            self._dispatch()

    def _publish(self, tensors: dict, version: int, servers: list[Server], *, broadcast: bool) -> None:
        """The weights to `servers`: over the weight group when `broadcast` (the disk path when
        that fails), else from disk. `last_sync_bytes`: what they moved."""
        if not (broadcast and self._broadcast(tensors, version, servers)):
            self._load_from_disk(tensors, version, servers)
        self.last_sync_bytes = sum(t.numel() * t.element_size() for t in tensors.values()) * len(servers)

    def _load_from_disk(self, tensors: dict, version: int, servers: list[Server]) -> None:
        path = self._save_weights(tensors, version)
        for srv in servers:
            res = self._control(srv, "POST", "/update_weights_from_disk",
                                {"model_path": str(path), "weight_version": str(version),
                                 "flush_cache": True})
            if isinstance(res, dict) and res.get("success") is False:
                log.warning("SGLang server %s refused /update_weights_from_disk: %s",
                            srv.url, snippet(json.dumps(res).encode()))
                raise EngineError(f"SGLang server {srv.url}: POST "
                                  f"/update_weights_from_disk refused {path} "
                                  "(its reply is in the worker's log)")

    def _broadcast(self, tensors: dict, version: int, servers: list[Server]) -> bool:
        """The weights to `servers` (every live one) over the weight group; False (after a
        warning, and with the disk path from now on) when the group cannot be built or the
        update fails."""
        try:
            group = self._group_for(servers, next(iter(tensors.values())).device)
            names = list(tensors)
            body = {"names": names, "dtypes": [str(tensors[n].dtype).removeprefix("torch.") for n in names],
                    "shapes": [list(tensors[n].shape) for n in names], "group_name": group.name,
                    "weight_version": str(version), "flush_cache": True}
            for srv in servers:
                self._call(srv, "POST", "/begin_weight_update", {}, retry=False)
            replies: dict[str, object] = {}

            def receive(srv):
                try:
                    replies[srv.url] = self._call(srv, "POST", "/update_weights_from_distributed",
                                                  body, retry=False)
                except EngineError as e:
                    replies[srv.url] = e

            threads = [threading.Thread(target=receive, args=(srv,), daemon=True) for srv in servers]
            for t in threads:
                t.start()
            for n in names:
                group.broadcast(tensors[n])
            for t in threads:
                t.join(self.timeout_s)
            for srv in servers:
                self._call(srv, "POST", "/end_weight_update", {}, retry=False)
            for url, reply in replies.items():
                if isinstance(reply, EngineError):
                    raise reply
                if isinstance(reply, dict) and reply.get("success") is False:
                    raise EngineError(f"SGLang server {url} refused /update_weights_from_distributed")
            if len(replies) < len(servers):
                raise EngineError("a server did not answer /update_weights_from_distributed in time")
        except (EngineError, RuntimeError, OSError) as e:
            self._close_group()
            self.weight_sync = "disk"
            self._warn(f"weights over torch.distributed failed ({e}); "
                       "/update_weights_from_disk from now on")
            return False
        return True

    def _group_for(self, servers: list[Server], device):
        """The weight group with exactly these servers, built on first use."""
        from trainer.engine.weight_group import WeightGroup

        urls = [srv.url for srv in servers]
        if self._weight_group is not None and self._weight_group_urls == urls:
            return self._weight_group
        self._close_group()   # a server left: a new group with those still in service
        tp = []
        for srv in servers:
            info = self._call(srv, "GET", "/server_info")
            tp.append(int(info.get("tp_size", 1)) if isinstance(info, dict) else 1)
        by_url = {srv.url: srv for srv in servers}
        self._weight_group = WeightGroup(
            urls, tp, name=f"rlpilot-{self._nonce}-{next(self._calls)}", timeout_s=self.timeout_s,
            backend="nccl" if getattr(device, "type", "cpu") == "cuda" else "gloo",
            join=lambda url, body: self._call(by_url[url], "POST", "/init_weights_update_group",
                                              body, retry=False))
        self._weight_group_urls = urls
        return self._weight_group

    def _close_group(self) -> None:
        group, self._weight_group = self._weight_group, None
        if group is None:
            return
        group.close()
        for srv in self.servers:   # the servers still up let go of their end
            if not srv.down and srv.url in self._weight_group_urls:
                try:
                    self._call(srv, "POST", "/destroy_weights_update_group",
                               {"group_name": group.name}, retry=False, timeout=5.0)
                except EngineError:
                    pass

    def _tensors_to_send(self, named_tensors) -> dict:
        """The servers' weights: rotary caches left out, and the head when it is the (tied)
        embedding; contiguous, on the trainer's device, in the servers' dtype when they all
        share one (precision.py: a bfloat16 server gets half the bytes)."""
        tied = bool(getattr(self.model_config, "tie_word_embeddings", False))
        items = named_tensors.items() if hasattr(named_tensors, "items") else named_tensors
        wire = self._wire_dtype()
        return {name: (t.detach().to(wire) if wire is not None and t.is_floating_point()
                       else t.detach()).contiguous() for name, t in items
                if not name.endswith("inv_freq") and not (tied and name == "lm_head.weight")}

    def _save_weights(self, named_tensors, version: int) -> Path:
        """A save_pretrained-style directory the servers load with /update_weights_from_disk."""
        import tempfile

        import torch
        from safetensors.torch import save_file

        from trainer.models.tensors import own_storage

        if self.weights_dir is None:
            self.weights_dir = Path(tempfile.mkdtemp(prefix="rlpilot-sglang-weights-"))
        root = self.weights_dir.resolve()
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"v{int(version):06d}"
        tmp = root / f".tmp-v{int(version):06d}"
        for p in (final, tmp):   # replace only what this engine wrote
            if p.exists() and not (p / WEIGHTS_MARKER).is_file():
                raise EngineError(f"{p} exists and was not written by rlpilot: not replacing it "
                                  "(choose an empty folder for the engine weights)")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        (tmp / WEIGHTS_MARKER).write_text(f"written by rlpilot's SGLang engine, version {int(version)}\n")
        tensors: dict[str, Any] = {}
        seen: set[tuple[int, int]] = set()
        with torch.no_grad():
            for name, t in named_tensors.items():   # safetensors refuses shared storage
                tensors[name] = own_storage(t.detach().to("cpu").contiguous(), seen)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if self.model_config is not None:
            self.model_config.save_pretrained(str(tmp))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        old = sorted(p for p in root.glob("v*")
                     if p.is_dir() and p != final and (p / WEIGHTS_MARKER).is_file())
        for p in old[:max(0, len(old) - (self.keep_weight_versions - 1))]:
            shutil.rmtree(p, ignore_errors=True)
        return final
