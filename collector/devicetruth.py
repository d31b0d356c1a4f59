"""Device truth for the flight log: on an accelerator, what completed and how far each rank got
is the device's, decided on a thread of the log's own from queries that never wait.

A collective's return and its future say only that it was enqueued (NCCL's `get_future()`
"only says whether the operation has been enqueued on the GPU"); `Work.is_completed()` queries
the work's end event, and an event recorded after a blocking collective passes once the
device ran it (the call made the current stream wait for it). The flight log hands each
collective and each step end to `DeviceTruth`; its thread marks them done in the log's file.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from meshscope.collector.service import Service

try:
    from torch._C._distributed_c10d import WorkResult
except ImportError:  # a torch before result futures: every backend answers through its future
    WorkResult = None


class DeviceTruth(Service):
    """The flight log's device thread: completion and progress from the device (module doc).

    It only ever *queries* (`Work.is_completed()`, `probe.ready(event)`); the host thread only
    appends. Collectives are checked each on its own (groups run on different streams, and
    the control plane's host group completes on the host); step ends in order."""

    def __init__(self, log: Any, probe: Any, poll_s: float) -> None:
        super().__init__("meshscope-flight-device", poll_s)
        self.log, self.probe, self.poll_s = log, probe, poll_s
        self._work: list[tuple[int, Callable[[], bool], Any]] = []
        self._steps: list[tuple[int, Any]] = []
        self._last_end: Any = None
        self._lock = threading.Lock()

    def watch(self, slot: int, result: Any) -> None:
        """A collective was enqueued: its Work when async, else an event after it (the call
        made the current stream wait for it, so the event passes once it ran)."""
        if result is not None and hasattr(result, "is_completed"):
            check, work = result.is_completed, result
        else:
            mark = self.probe.mark()
            check, work = (lambda: self.probe.ready(mark)), None
        with self._lock:
            self._work.append((slot, check, work))

    def step_ended(self, step: int, mark: Any) -> None:
        """The host reached the end of `step`; the device gets there at `mark`."""
        with self._lock:
            self._steps.append((step, mark))

    def before_rounds(self) -> None:
        """Bind the rank's device before the first query: this thread would start on device 0."""
        bind = getattr(self.probe, "bind", None)
        if bind is not None:
            bind()

    def round(self) -> None:
        """One round of queries (a failed one is logged and counted: `Service`)."""
        self.poll()

    def poll(self) -> None:
        """One round of queries."""
        with self._lock:
            work, steps = list(self._work), list(self._steps)
        finished = []
        for entry in work:
            slot, check, handle = entry
            if check():
                self.log.finish(slot, _work_error(handle))
                finished.append(entry)
        done_steps = 0
        for step, mark in steps:
            if not self.probe.ready(mark):
                break
            took = self.probe.seconds(self._last_end, mark) if self._last_end is not None else 0.0
            self._last_end = mark
            self.log.progressed(step, took)
            done_steps += 1
        with self._lock:
            gone = {id(e) for e in finished}
            self._work = [e for e in self._work if id(e) not in gone]
            del self._steps[:done_steps]


def _work_error(work: Any) -> BaseException | None:
    """The error a finished Work met (None: success, or not known yet), asked the way each
    backend answers without waiting:

    - NCCL: `isCompleted()` is `exception() || finishedGPUExecutionInternal()`, so a failed
      collective is "completed" too; `checkAndSetException()` then marks the work's result
      future `WorkResult::COMM_ERROR` (`TIMEOUT` from `checkTimeout`), and the watchdog marks
      it `SUCCESS` later (ProcessGroupNCCL.cpp). `isSuccess()` throws ("deprecated"), so it
      is never asked; `exception()` warns once, so it is asked only for a failure's text.
    - gloo and other host backends have no result future ("Work::getFutureResult not
      implemented"): their future holds the collective's error.
    """
    if work is None:
        return None
    if WorkResult is None:
        return _future_error(work)
    try:
        outcome = work.get_future_result()
    except (AttributeError, RuntimeError):  # a host backend: its future says
        return _future_error(work)
    if not outcome.done():
        return None
    code = int(outcome.value())
    if code == int(WorkResult.SUCCESS):
        return None
    return _failure(work, code)


def _failure(work: Any, code: int) -> BaseException:
    """The backend's own error where it keeps one, else the result's name."""
    names = {int(v): k for k, v in WorkResult.__members__.items()}
    try:
        error = work.exception()
    except Exception:  # noqa: BLE001  (a backend without it: the result code says enough)
        error = None
    if isinstance(error, BaseException):
        return error
    return dist.DistBackendError(f"collective ended {names.get(code, code)}")


def _future_error(work: Any) -> BaseException | None:
    try:
        future = work.get_future()
    except (AttributeError, RuntimeError):  # gloo's send/recv work has none
        return None
    if not future.done():
        return None
    try:
        future.value()
    except Exception as err:  # noqa: BLE001  (the collective's own error)
        return err
    return None
