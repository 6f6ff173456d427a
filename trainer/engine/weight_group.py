"""The trainer's end of a torch.distributed group with SGLang servers, for weight updates
without a file: rank 0 is the trainer, the servers' ranks follow (`rank_offset`), and each update
is one broadcast per tensor from rank 0 (NCCL on GPUs, gloo on CPU).

The servers join through their own HTTP call `/init_weights_update_group`, which builds the group
with SGLang's `init_custom_process_group` -- torch's internal `_new_process_group_helper` over a
TCP rendezvous and a store prefixed with the group's name, the recipe OpenRLHF, verl and slime
use too. The trainer must build its end the same way: the public `new_group` only makes
subgroups of one default group holding every member, and a trainer and separately launched
servers share none (the trainer may even be rank 0 of its own torchrun group). So this module
calls the same internal helper, in one place, and says so.
"""
from __future__ import annotations

import datetime
import socket
import threading
from typing import Callable
from urllib.parse import urlsplit

import torch

from trainer.engine.base import EngineError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def address_towards(url: str) -> str:
    """The local IP address the servers can reach this process at: loopback for a local server,
    else the address of the interface that routes to the server's host (no packet is sent)."""
    host = urlsplit(url).hostname or "127.0.0.1"
    if host in LOOPBACK:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


class WeightGroup:
    """Rank 0 of a process group with the servers; `broadcast` sends one tensor to all."""

    def __init__(self, urls: list[str], tp_sizes: list[int], *, name: str, backend: str,
                 timeout_s: float, join: Callable[[str, dict], object]):
        """`join(url, body)` posts /init_weights_update_group to one server (it returns when the
        group is built, so every call runs on its own thread while rank 0 waits here)."""
        from torch.distributed.distributed_c10d import (
            Backend,
            PrefixStore,
            _new_process_group_helper,
            _world,
            rendezvous,
        )

        self.name, self.backend = name, backend
        self.world_size = 1 + sum(tp_sizes)
        address = address_towards(urls[0])
        port = free_port(address)
        errors: list[str] = []
        threads, offset = [], 1
        for url, tp in zip(urls, tp_sizes):
            body = {"master_address": address, "master_port": port, "rank_offset": offset,
                    "world_size": self.world_size, "group_name": name, "backend": backend}
            threads.append(threading.Thread(target=self._join, args=(join, url, body, errors),
                                            daemon=True, name="rlpilot-weight-group-join"))
            offset += tp
        for t in threads:
            t.start()
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store, _, _ = next(rendezvous(f"tcp://{address}:{port}", 0, self.world_size,
                                          timeout=timeout))
            store.set_timeout(timeout)
            self.group, _ = _new_process_group_helper(
                self.world_size, 0, [], Backend(backend), PrefixStore(name, store),
                group_name=name, backend_options=None, timeout=timeout)
            _world.pg_group_ranks[self.group] = {i: i for i in range(self.world_size)}
        except Exception as e:
            raise EngineError(f"weight group {name}: the servers did not join ({errors or e})") from e
        finally:
            for t in threads:
                t.join(timeout_s)
        if errors:
            self.close()
            raise EngineError(f"weight group {name}: " + "; ".join(errors))

    @staticmethod
    def _join(join, url, body, errors) -> None:
        try:
            res = join(url, body)
            if isinstance(res, dict) and res.get("success") is False:
                errors.append(f"{url} refused to join")
        except Exception as e:   # reported by the constructor
            errors.append(f"{url}: {e}")

    def broadcast(self, tensor: torch.Tensor) -> None:
        torch.distributed.broadcast(tensor, src=0, group=self.group)

    def close(self) -> None:
        group, self.group = getattr(self, "group", None), None
        if group is not None:
            try:
                torch.distributed.destroy_process_group(group)
            except Exception:   # a broken group (a server died) may refuse a clean teardown
                pass
