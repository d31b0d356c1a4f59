"""Gradient communication hooks: none, fp16, powersgd (torch's) and onebit (ours).

Each is a `HookSpec`: the hook, its state, and how many bytes it puts on the wire per bucket,
counted the same way for all (see collector.comm). The Monitor wraps the hook with timing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from meshscope.collector.comm import allreduce_sent_bytes, allreduce_wire_bytes, bucket_bytes
from meshscope.trainer.onebit import OneBitState, onebit_hook, onebit_wire_bytes
from meshscope.trainer.onebit_adam import onebit_adam_hook, onebit_adam_wire_bytes
from meshscope.trainer.serial import serial_hook, wait_for

# With one bucket as large as the model, communication starts only when backward is done:
# the all-reduce-after-backward baseline, through the same DDP and hooks.
NO_OVERLAP_BUCKET_MB = 1 << 16


@dataclass
class HookSpec:
    """A gradient hook as the Monitor registers it: how it reduces and what it sends."""

    name: str
    hook: Callable[..., Any] | None
    state: Any
    wire_bytes: Callable[[Any, Any, int], int]
    inter_bytes: Callable[[Any, Any, int], int] | None = None  # None: a flat ring's share


def fp16_wire_bytes(state: Any, bucket: dist.GradBucket, world_size: int) -> int:
    """Bytes an fp16-compressed bucket puts on the wire."""
    return allreduce_sent_bytes(bucket_bytes(bucket) // 2, world_size)


def powersgd_wire_bytes(state: powersgd.PowerSGDState, bucket: dist.GradBucket, world_size: int) -> int:
    """Mirror torch's PowerSGD: plain all-reduce while warming up; then P and Q all-reduces for
    the matrices worth compressing, and one all-reduce of everything else."""
    if state.iter < state.start_powerSGD_iter:
        return allreduce_sent_bytes(bucket_bytes(bucket), world_size)
    rank = state.matrix_approximation_rank
    payload = 0
    for grad in bucket.gradients():
        size = grad.element_size()
        if grad.ndim <= 1:
            payload += grad.numel() * size
            continue
        rows, cols = grad.shape[0], grad.numel() // grad.shape[0]
        compress, uncompressed, compressed = powersgd._should_compress(
            rows, cols, rank, state.min_compression_rate
        )
        payload += (compressed if compress else uncompressed) * size
    return allreduce_sent_bytes(payload, world_size)


FRESH_Q_SEED = 20_260_604  # PowerSGD's Q where a NaN was: drawn alike on every rank


def finite_memories(hook: Any) -> Any:
    """PowerSGD whose memories never keep a non-finite value past its step. A NaN gradient
    (skipped by every rank) leaves NaN in the bucket's error feedback and warm-started Q, and
    torch's hook would add it to every later gradient: before each bucket, the error's
    non-finite values become 0 and Q's are taken from a spare drawn once per bucket with a seed
    alike on every rank (Q is the same on every rank). Device-side: no sync, no draw per step."""
    spares: dict[int, torch.Tensor] = {}  # bucket -> the Q it takes where its own is not finite

    def sane(state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
        index = bucket.index()
        error = state.error_dict.get(index)
        if error is not None:
            torch.nan_to_num_(error, nan=0.0, posinf=0.0, neginf=0.0)
        q = state.q_memory_dict.get(index)
        if q is not None:
            if index not in spares or spares[index].shape != q.shape:  # drawn once per bucket
                draw = torch.Generator(q.device).manual_seed(FRESH_Q_SEED + index)
                spares[index] = torch.randn(q.shape, generator=draw, device=q.device, dtype=q.dtype)
            q.copy_(torch.where(torch.isfinite(q), q, spares[index]))
        return hook(state, bucket)

    return sane


def build_hook(
    name: str, *, process_group: Any = None, powersgd_rank: int = 4, seed: int = 0, warmup_steps: int = 0
) -> HookSpec:
    """The communication hook called `name` (the `train.compression` values)."""
    if name == "none":  # the Monitor's own timed all-reduce: the cheapest way to time it
        return HookSpec(name, None, process_group, allreduce_wire_bytes)
    if name == "fp16":
        return HookSpec(name, default_hooks.fp16_compress_hook, process_group, fp16_wire_bytes)
    if name == "powersgd":
        state = powersgd.PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=max(2, warmup_steps),
            min_compression_rate=2,
            use_error_feedback=True,
            warm_start=True,
            random_seed=seed,
        )
        hook = serial_hook(wait_for(finite_memories(powersgd.powerSGD_hook)), "powersgd")  # trainer/serial.py
        return HookSpec(name, hook, state, powersgd_wire_bytes)
    if name == "onebit":
        state = OneBitState(process_group=process_group, warmup_steps=warmup_steps)
        return HookSpec(name, onebit_hook, state, onebit_wire_bytes)
    if name == "onebit_adam":  # the optimizer compresses the momentum: trainer/onebit_adam.py
        state = OneBitState(process_group=process_group, warmup_steps=max(1, warmup_steps))
        return HookSpec(name, onebit_adam_hook, state, onebit_adam_wire_bytes)
    raise ValueError(f"train.compression: unknown hook {name!r} (none, fp16, powersgd, onebit, onebit_adam)")
