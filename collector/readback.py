"""Reading device values without draining the device's queue.

A `Readback` is one non-blocking copy of a device tensor into pinned host memory, followed by
an event on the same stream. Its value is read once `ready()` (the event says the copy is done),
typically a window later; `wait()` blocks and is kept for flush and shutdown. A host tensor
needs none of this: it is ready at once.
"""

from __future__ import annotations

from typing import Any

import torch


def is_device_tensor(value: Any) -> bool:
    """A tensor whose value lives on an accelerator (reading it would wait for the device)."""
    return isinstance(value, torch.Tensor) and value.device.type != "cpu"


def device_event(device: torch.device) -> Any:
    """An event recorded now on the current stream of `device` (CUDA or Ascend)."""
    module = getattr(torch, device.type)
    event = module.Event()
    event.record()
    return event


class Readback:
    """A device tensor on its way to the host (see the module doc)."""

    def __init__(self, tensor: torch.Tensor, *, owned: bool = False) -> None:
        """`owned`: nothing writes `tensor` after this (a host tensor is then kept, not copied)."""
        tensor = tensor.detach()
        if not is_device_tensor(tensor):
            self._host, self._event = (tensor if owned else tensor.clone()), None
            return
        # pinned memory makes the copy truly asynchronous (a CPU tensor gets here only when a
        # test stands in for a device)
        pinned = tensor.device.type != "cpu"
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
        self._host.copy_(tensor, non_blocking=True)
        self._event = device_event(tensor.device)

    def ready(self) -> bool:
        """True once the copy has landed (never blocks)."""
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        """Block until the copy has landed."""
        if self._event is not None:
            self._event.synchronize()  # sync point: flush and shutdown only

    def value(self) -> torch.Tensor:
        """The host copy; call after `ready()` is true or `wait()` returned."""
        return self._host


class ScalarWindow:
    """Logged device scalars of several steps: gathered into one buffer, read back at once."""

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []
        self._size = 0
        self.readback: Readback | None = None
        self._host: list[float] | None = None

    def add(self, values: list[torch.Tensor]) -> int:
        """Queue 0-d device tensors (kept on the device); returns their offset in the window."""
        offset = self._size
        self._parts.append(torch.stack([v.detach().reshape(()).float() for v in values]))
        self._size += len(values)
        return offset

    def close(self) -> None:
        """One device-side concatenation and one non-blocking copy for the whole window."""
        if self._parts and self.readback is None:
            self.readback = Readback(torch.cat(self._parts), owned=True)
            self._parts = []

    def ready(self) -> bool:
        """True once closed and copied (never blocks); an empty window is always ready."""
        return not self._parts and (self.readback is None or self.readback.ready())

    def wait(self) -> None:
        """Close the window and wait for its copy to land (flush and close only)."""
        self.close()
        if self.readback is not None:
            self.readback.wait()

    def values(self, offset: int, count: int) -> list[float]:
        """Host floats of one step's scalars; the window must be ready."""
        if self._host is None:
            self._host = self.readback.value().tolist()  # host memory: already landed
        return self._host[offset : offset + count]
