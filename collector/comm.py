"""Timing and byte counting of DDP communication hooks, whatever the hook compresses.

Bytes on the wire are counted the same way for every hook: what this rank sends for each
collective it issues, by the standard algorithm costs (ring all-reduce 2(W-1)/W of the payload,
all-to-all (W-1)/W, all-gather (W-1) times the own chunk). Hooks describe their collectives
through a `wire_bytes(bucket, state, world_size)` function.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from collector.probe import DeviceProbe

Hook = Callable[[Any, "dist.GradBucket"], torch.futures.Future]
WireBytes = Callable[[Any, "dist.GradBucket", int], int]


def allreduce_sent_bytes(payload: int, world_size: int) -> int:
    return 0 if world_size <= 1 else (2 * (world_size - 1) * payload) // world_size


def alltoall_sent_bytes(payload: int, world_size: int) -> int:
    return 0 if world_size <= 1 else ((world_size - 1) * payload) // world_size


def allgather_sent_bytes(own_chunk: int, world_size: int) -> int:
    return max(0, world_size - 1) * own_chunk


def bucket_bytes(bucket: "dist.GradBucket") -> int:
    buf = bucket.buffer()
    return buf.numel() * buf.element_size()


def allreduce_wire_bytes(state: Any, bucket: "dist.GradBucket", world_size: int) -> int:
    """Wire bytes of the plain all-reduce hook: the whole fp32 bucket, ring all-reduced."""
    return allreduce_sent_bytes(bucket_bytes(bucket), world_size)


@dataclass
class CommWindow:
    """Communication seen during one step: launches and completions as probe marks."""

    spans: list[tuple[Any, Any]] = field(default_factory=list)
    last_launch: Any = None
    bytes_raw: int = 0
    bytes_wire: int = 0


class CommMeter:
    """Collects per-bucket launches/completions; the Monitor swaps windows at step boundaries."""

    def __init__(self, probe: DeviceProbe) -> None:
        self.probe = probe
        self._lock = threading.Lock()  # completions arrive on the backend's threads
        self._window = CommWindow()

    def launched(self, raw: int, wire: int) -> list[Any]:
        mark = self.probe.mark()
        span = [mark, None]
        with self._lock:
            self._window.last_launch = mark
            self._window.bytes_raw += raw
            self._window.bytes_wire += wire
            self._window.spans.append(span)  # type: ignore[arg-type]
        return span

    def completed(self, span: list[Any]) -> None:
        span[1] = self.probe.mark()

    def take(self) -> CommWindow:
        with self._lock:
            window, self._window = self._window, CommWindow()
        return window


def instrument_hook(hook: Hook, meter: CommMeter, wire_bytes: WireBytes, world_size: int) -> Hook:
    """Wrap a DDP comm hook so each bucket's communication is timed and its bytes counted."""

    def timed_hook(state: Any, bucket: "dist.GradBucket") -> torch.futures.Future:
        span = meter.launched(bucket_bytes(bucket), wire_bytes(state, bucket, world_size))
        fut = hook(state, bucket)

        def done(f: torch.futures.Future) -> Any:
            meter.completed(span)
            return f.value()

        # `then`, not add_done_callback: DDP waits on the chained future, so the completion
        # mark is in place before the step's record is built.
        return fut.then(done)

    timed_hook.__name__ = f"timed_{getattr(hook, '__name__', 'hook')}"
    # DDP checks real annotation objects, not the strings `from __future__` leaves.
    timed_hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                  "return": torch.futures.Future[torch.Tensor]}
    return timed_hook


def timed_allreduce_hook(meter: CommMeter, world_size: int, process_group: Any = None) -> Hook:
    """Plain averaging all-reduce with timing built in: one future and one callback per bucket.

    This is the Monitor's default when a DDP model has no compression. It calls the process
    group's C++ method directly; the Python `dist.all_reduce` wrapper plus torch's Python
    `allreduce_hook` and a timing wrapper around it cost ~100 us per bucket, which a model
    with many buckets notices.
    """
    group = process_group

    def allreduce(state: Any, bucket: "dist.GradBucket") -> torch.futures.Future:
        pg = group or dist.distributed_c10d._get_default_group()
        tensor = bucket.buffer()
        size = tensor.numel() * tensor.element_size()
        span = meter.launched(size, allreduce_sent_bytes(size, world_size))
        tensor.div_(world_size)

        def done(f: torch.futures.Future) -> torch.Tensor:
            meter.completed(span)
            return f.value()[0]

        return pg.allreduce([tensor]).get_future().then(done)

    allreduce.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                 "return": torch.futures.Future[torch.Tensor]}
    return allreduce
