"""DDP's sampled communication time, read on a thread of its own (`DDPRuntimeStats`): a
reduction that holds DDP's lock (a rank stuck in it) stalls that thread only, and the Monitor's
drain goes on with the figure read before."""

import threading
import time
from types import SimpleNamespace

from meshscope.collector.comm import DDPRuntimeStats


class _Logger:
    """DDP's C++ logger as the binding shows it: `_get_ddp_logging_data()` waits for the
    reducer's lock (here: `lock`) and returns the struct whose `ints_map` holds the figure."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.comm_ns = 0

    def _get_ddp_logging_data(self) -> SimpleNamespace:
        with self.lock:
            ints = {"backward_comm_time": self.comm_ns, "backward_comm_time_end": 1 + self.comm_ns}
            return SimpleNamespace(ints_map=ints if self.comm_ns else {})


def test_the_figure_is_read_when_asked_and_a_held_lock_stalls_no_one_else():
    logger = _Logger()
    stats = DDPRuntimeStats(SimpleNamespace(logger=logger), None).start()
    try:
        assert stats.refresh(5.0) is None  # nothing sampled yet
        logger.comm_ns = 3_000_000
        assert stats.refresh(5.0) == 0.003
        logger.lock.acquire()  # a rank stuck in its reduction holds DDP's lock
        logger.comm_ns = 7_000_000
        started = time.perf_counter()
        assert stats.refresh(0.05) == 0.003  # the figure read before, after the wait asked for
        assert time.perf_counter() - started < 2.0
        started = time.perf_counter()
        assert stats.refresh(30.0) == 0.003  # that read still waits: this one does not wait again
        assert time.perf_counter() - started < 10.0
        logger.lock.release()
        deadline = time.monotonic() + 5.0
        while stats.refresh(0.5) != 0.007 and time.monotonic() < deadline:
            pass
        assert stats.latest == 0.007
    finally:
        assert stats.stop()
    assert not stats.running
