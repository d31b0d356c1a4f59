"""The flight log's step marks: the step a rank is in, its progress and typical step time
(what the hang watchdog scales its patience by), and the records of DDP's reduction that each
step completes. On the host a step's end writes its progress at once (two numbers in the
header, in C or here: the watchdog's progress is as fresh as the step whatever the drain's
cadence) and queues the rest, which the Monitor's drain writes within its round
(`defer_ends`); C's untimed steps leave their reduction's record itself to the drain
(`write_opens`)."""

from __future__ import annotations

import struct
import time
from typing import Any

from meshscope.collector.flightread import DEVICE_STEP_OFFSET, PROGRESS_OFFSET, STEP_OFFSET, STEP_S_OFFSET

_STEP = struct.Struct("<q")
_TIME = struct.Struct("<d")


class StepMarks:
    """`FlightLog`'s step marks (module doc): they use its map, lock and ring."""

    _map: Any
    _step_started: float
    _step_s: float
    _polled: list
    _device: Any
    _ends: Any
    _opens: Any
    _opened: dict
    _written: int
    _lock: Any
    _settling: Any
    capacity: int
    defer_ends: bool

    @property
    def step(self) -> int:
        """The step the Monitor said is running (-1 before the first): the header's, the one
        place it is kept (C writes it there alone, `collector/csrc/`)."""
        return _STEP.unpack_from(self._map, STEP_OFFSET)[0]

    def step_begin(self, step: int) -> None:
        """The Monitor says a step starts: records carry it."""
        self._step_started = time.perf_counter()
        _STEP.pack_into(self._map, STEP_OFFSET, step)

    def step_end(self, mark: Any = None, reduced: Any = ()) -> None:
        """A step ended: progress, the typical step time the watchdog scales by, and the
        reductions it finished (`reduced`: their slots). On a device, `mark` (the step's end
        event) says when the device ended it. On the host the times are taken now, progress
        written at once, and the rest queued where a service writes it (`defer_ends`: the
        Monitor's drain, within its round)."""
        if self._polled:
            self.settle_polled()
        if self._device is not None and mark is not None:
            for slot in reduced:
                self.reduction_done(slot)
            self._device.step_ended(self.step, mark)
            return
        took, at = time.perf_counter() - self._step_started, time.time()
        self._ends.append((self.step, took, at, reduced, self._written))
        self.reached(self.step, at)
        if not self.defer_ends:
            self.settle_ends()

    def settle_ends(self) -> None:
        """Write the step ends the training thread queued (`step_end`), oldest first. A slot
        the ring has given to a newer record since is left alone: its reduction is gone."""
        with self._settling:
            self.write_opens()
            if self._ends:
                self._write_ends()

    def _write_ends(self) -> None:
        ends = self._ends
        while ends:
            _, took, at, reduced, written = ends.popleft()
            for item in reduced:
                if item.__class__ is tuple:  # an open C left to the drain: written above
                    slot, issued = self._opened.pop(item[:2], (-1, -self.capacity - 1))
                else:  # a slot, written as it was issued
                    slot, issued = item, written - 1 - (written - 1 - item) % self.capacity
                if self._written - issued <= self.capacity:
                    self.reduction_done(slot, at)
            self._smooth(took)
        self._write_step_s()  # the header says the latest: one write a round, not one a step

    def write_opens(self) -> None:
        """Write the records C issued on the training thread and left to the drain, in the
        order issued (`collector/csrc/`: DDP's reduction opened by an untimed step's forward,
        its sequence number taken then): each one's slot and index are kept for its step's
        end. A rank stuck in that reduction has it written by the next round, or by the
        watchdog's stacks request. Under `_settling`."""
        while self._opens:
            name, seq, tail, step, issued = entry = self._opens.popleft()
            with self._lock:
                self._opened[entry[:2]] = (self._put(name, tail, seq, step, issued), self._written - 1)

    def progressed(self, step: int, took: float, at: float | None = None) -> None:
        """Step `step` is finished (by the host, or by the device) and took `took` seconds
        (0: unknown, the first step a device reports); `at`: when (default now)."""
        self._smooth(took)
        self.reached(step, time.time() if at is None else at)
        self._write_step_s()

    def _smooth(self, took: float) -> None:
        # a slow EMA: one slow step (a checkpoint) must not raise the stall threshold much
        if took > 0:
            self._step_s = took if self._step_s == 0.0 else 0.9 * self._step_s + 0.1 * took

    def reached(self, step: int, at: float) -> None:
        """Step `step` ended at `at`: the watchdog's progress (C writes the same as its steps
        end, `collector/csrc/`)."""
        _TIME.pack_into(self._map, PROGRESS_OFFSET, at)
        _STEP.pack_into(self._map, DEVICE_STEP_OFFSET, step)

    def _write_step_s(self) -> None:
        _TIME.pack_into(self._map, STEP_S_OFFSET, self._step_s)
