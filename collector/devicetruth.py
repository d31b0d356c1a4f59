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


class DeviceTruth:
    """The flight log's device thread: completion and progress from the device (module doc).

    It only ever *queries* (`Work.is_completed()`, `probe.ready(event)`); the host thread only
    appends. Collectives are checked each on its own (groups run on different streams, and
    the control plane's host group completes on the host); step ends in order."""

    def __init__(self, log: Any, probe: Any, poll_s: float) -> None:
        self.log, self.probe, self.poll_s = log, probe, poll_s
        self._work: list[tuple[int, Callable[[], bool], Any]] = []
        self._steps: list[tuple[int, Any]] = []
        self._last_end: Any = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshscope-flight-device", daemon=True)

    def start(self) -> DeviceTruth:
        """Query on a thread of its own until `stop()`."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop querying (the log is closing)."""
        self._stop.set()

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

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001  (a query must never take the job down)
                continue

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
    """The error a finished Work met, where it says (None: success, or unknown). Its future
    holds a host backend's error; `Work.exception()` is deprecated in c10d, so it is not
    asked; the simulated stream keeps its own (`stream_error`)."""
    if work is None:
        return None
    own = getattr(work, "stream_error", None)
    if callable(own):
        return own()
    future = work.get_future() if hasattr(work, "get_future") else None
    if future is None or not future.done():
        return None
    try:
        future.value()
    except Exception as err:  # noqa: BLE001  (the collective's own error)
        return err
    return None
