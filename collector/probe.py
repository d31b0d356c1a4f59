"""How the Monitor reads time and memory without knowing the device.

The trainer's device layer supplies an accelerator probe (CUDA/NPU events); the host probe
here serves CPUs and any loop that does not say otherwise.
"""

from __future__ import annotations

import os
import time
from typing import Any, Protocol


class DeviceProbe(Protocol):
    """Time points on the device's timeline and memory figures.

    `mark()` must not block. `ready(m)` says, without blocking, whether a mark has been
    reached; `seconds(a, b)` is called only on ready marks, so it never waits. `wait(m)` blocks
    (flush and shutdown only). `memory()` must not block either. `asynchronous` says whether
    marks can be unready at all.
    """

    asynchronous: bool

    def mark(self) -> Any:
        """Record a point on the device's stream (an event); returns it."""

    def ready(self, mark: Any) -> bool:
        """Whether the device has passed `mark` (never blocks)."""

    def wait(self, mark: Any) -> None:
        """Block until the device has passed `mark` (a sync point)."""

    def seconds(self, start: Any, end: Any) -> float:
        """Device time between two passed marks."""

    def memory(self) -> dict[str, int]:
        """Allocated, reserved and host RSS bytes."""


def mark_ready(probe: Any, mark: Any) -> bool:
    """`probe.ready(mark)`, for probes written before `ready` existed (host-like: True)."""
    ready = getattr(probe, "ready", None)
    return True if ready is None else bool(ready(mark))


def wait_mark(probe: Any, mark: Any) -> None:
    """`probe.wait(mark)` where the probe has it."""
    wait = getattr(probe, "wait", None)
    if wait is not None:
        wait(mark)


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


_statm: list[int] = []  # the open fd of /proc/self/statm (read every step; a fork reopens it)


def _forget_statm() -> None:
    # the inherited fd reads the parent's statm: close it, and open the child's when asked
    for fd in _statm:
        os.close(fd)
    _statm.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_statm)


def host_rss_bytes() -> int:
    """Resident set size of this process; 0 where /proc is not there."""
    try:
        if not _statm:
            _statm.append(os.open("/proc/self/statm", os.O_RDONLY))
        return int(os.pread(_statm[0], 128, 0).split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


class HostProbe:
    """perf_counter timing and RSS: exact and free on the CPU."""

    asynchronous = False
    kind = "cpu"

    # Now, on the host clock: perf_counter itself, so taking a mark runs no Python frame (the
    # training thread takes two or more a step).
    mark = staticmethod(time.perf_counter)

    def ready(self, mark: float) -> bool:
        """Always: the host has passed every mark it made."""
        return True

    def wait(self, mark: float) -> None:
        """Nothing to wait for on the host."""
        return None

    def seconds(self, start: float, end: float) -> float:
        """Host time between two marks."""
        return max(0.0, end - start)

    def memory(self) -> dict[str, int]:
        """Host RSS (no device memory on the CPU)."""
        return {"allocated": 0, "reserved": 0, "rss": host_rss_bytes()}
