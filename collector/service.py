"""One lifecycle for everything meshscope runs beside training on a thread of its own.

The Monitor's drain, the store writer, the flight log's stack responder, the device-truth
queries, the relay, heartbeats and their watchers, the hang watchdog and live detection each
repeat one round every interval, or sooner when woken (a flush, a request). They share what a
demanding operator needs from all of them: `start()` once, `stop()` that waits a bounded time
and says whether the thread ended, a round that fails is logged (the first few in full, then
every power of two) and counted in `failures`, never the end of training, and after a fork the
child holds no thread of its parent's: it may start its own.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref

log = logging.getLogger("meshscope.service")

_LOGGED_IN_FULL = 3  # failures logged with their traceback before thinning out
_ALL: weakref.WeakSet[Service] = weakref.WeakSet()


def due(since: float, every_s: float, slack_s: float = 0.0) -> bool:
    """Whether `every_s` has passed since the monotonic time `since`, less `slack_s` (a round
    woken a little early is not put off a whole round)."""
    return time.monotonic() - since + slack_s >= every_s


class Service:
    """A thread that runs `round()` every `interval_s` until `stop()`; a round that returns
    False ends it (what it watched is gone), and so does any failed round where
    `ends_on_error` (a store torn down under a heartbeat: one warning, no traceback)."""

    ends_on_error = False

    def __init__(self, name: str, interval_s: float, *, join_s: float = 5.0) -> None:
        self.name, self.interval_s, self.join_s = name, interval_s, join_s
        self.failures = 0  # rounds that raised, since construction
        self._stop = threading.Event()
        self._wake = threading.Event()  # the next round now (a flush), or the end (stop)
        self._thread: threading.Thread | None = None
        _ALL.add(self)

    def start(self) -> Service:
        """Run rounds on a thread of its own (again after a `stop()`); returns self."""
        if self.running:
            return self
        self._stop, self._wake = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self, wait: bool = True) -> bool:
        """Ask the thread to end after its round and wait at most `join_s` (not at all without
        `wait`: a thread that sleeps in the kernel ends when it wakes); whether it ended."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread() or not wait:
            return True
        thread.join(self.join_s)
        if thread.is_alive():
            log.warning("%s did not stop within %.0f s; it ends with the process", self.name, self.join_s)
            return False
        return True

    @property
    def running(self) -> bool:
        """Whether its thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def stopping(self) -> bool:
        """Whether `stop()` was asked (a long round may look and return early)."""
        return self._stop.is_set()

    def wake(self) -> None:
        """Run the next round now, not at the interval's end (a flush that waits for it)."""
        self._wake.set()

    def before_rounds(self) -> None:
        """Runs once on the service's thread before its first round (binding a device, say)."""

    def after_rounds(self) -> None:
        """Runs once on the service's thread after its last round (writing what is left)."""

    def idle(self) -> None:
        """Wait between rounds: the interval, or less when woken."""
        self._wake.wait(self.interval_s)
        self._wake.clear()

    def round(self) -> bool | None:
        """One round of work; False ends the service."""
        raise NotImplementedError

    def _run(self) -> None:
        if self._guarded(self.before_rounds) is False:
            return
        try:
            while True:
                self.idle()
                if self._stop.is_set() or self._guarded(self.round) is False:
                    return
        finally:
            self._guarded(self.after_rounds)

    def _guarded(self, work) -> bool | None:  # noqa: ANN001
        try:
            return work()
        except Exception as err:  # a round must never take training down
            self.failures += 1
            if self.ends_on_error:
                log.warning("%s stopped: %s", self.name, err)
                return False
            n = self.failures
            if n <= _LOGGED_IN_FULL or n & (n - 1) == 0:
                log.exception("%s: round failed (%d so far)", self.name, n)
            return None


def _forget_threads_after_fork() -> None:
    """A forked child has none of its parent's threads: its services are stopped, startable."""
    for service in list(_ALL):
        service._thread = None
        service._stop, service._wake = threading.Event(), threading.Event()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_threads_after_fork)
