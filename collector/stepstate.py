"""What the training thread keeps between one step's entry points, in one place.

A step's entry, its model's forward, its backward's callbacks and its exit hand each other a
few facts: the step begun, whether it is timed, whether a backward reduced gradients, the
flight records its forwards opened, whether communication was counted, the latest memory
reading. Where C runs the steps (`collector/csrc/`), its `Steps` keeps these fields in its own
struct: read there, a field costs one cache line, where an attribute of the watch, the meter
or the Monitor costs a dictionary lookup, ~1 us cold after a step's compute. `StepState` is
the same fields where steps run in Python only."""

from __future__ import annotations

from typing import Any


class StepState:
    """The fields C's `Steps` keeps (module doc), for steps in Python."""

    __slots__ = ("current", "memory", "timing", "reduced", "opened", "dirty")

    def __init__(self) -> None:
        self.current = -1  # the latest step begun
        self.memory: dict[str, int] = {}  # the latest memory reading (one step in memory_every)
        self.timing = True  # the step in progress is timed (`detail_every`)
        self.reduced = False  # a backward that reduces gradients ran since the last take
        self.opened: list[Any] = []  # flight records an untimed step's forwards opened
        self.dirty = False  # the comm window holds something since its last take
