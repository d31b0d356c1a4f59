"""Run a function on N gloo ranks in fresh processes and collect what each returns."""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.ports import free_port_range


def _entry(
    rank: int, fn: Callable[..., Any], world: int, port: int, out: str, kwargs: dict, backend: str
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = fn(rank=rank, world_size=world, **kwargs)
        # on success nobody tears down gloo while a peer still talks (a host barrier)
        dist.barrier(group=None if backend == "gloo" else dist.new_group(backend="gloo"))
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int = 2, backend: str = "gloo", **kwargs: Any) -> list[Any]:
    """fn(rank=, world_size=, **kwargs) on every rank; returns the results in rank order.

    `backend="cuda:gloo"` gives a default group that, like nccl and hccl, refuses host
    tensors ("No backend type associated with device type cpu"): a CPU stand-in for an
    accelerator's group."""
    port = free_port_range(1)
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _entry,
            args=(fn, world_size, port, out, kwargs, backend),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        return [pickle.loads(Path(out, f"{r}.pkl").read_bytes()) for r in range(world_size)]
