"""The one lifecycle of what runs beside training: bounded stops, failures logged and counted
(never the end of the thread), a round that ends it, a restart, and a fork that inherits no
thread."""

from __future__ import annotations

import logging
import os
import threading
import time

from meshscope.collector.service import Service


class Counting(Service):
    """Counts rounds; fails on the rounds it is told to; ends when told to."""

    def __init__(self, fail: set[int] = frozenset(), end_at: int = -1, slow_s: float = 0.0) -> None:
        super().__init__("meshscope-test-service", 0.001, join_s=0.5)
        self.rounds, self.fail, self.end_at, self.slow_s = 0, set(fail), end_at, slow_s

    def round(self) -> bool | None:
        self.rounds += 1
        time.sleep(self.slow_s)
        if self.rounds in self.fail:
            raise RuntimeError(f"round {self.rounds} broke")
        return False if self.rounds == self.end_at else None


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_a_failed_round_is_logged_and_counted_and_the_rounds_go_on(caplog):
    service = Counting(fail={2, 3, 4, 5, 6, 7, 8, 9})
    with caplog.at_level(logging.ERROR, logger="meshscope.service"):
        service.start()
        _wait_for(lambda: service.rounds > 12)
        assert service.stop() and not service.running
    assert service.failures == 8
    logged = [r for r in caplog.records if "round failed" in r.getMessage()]
    assert [r.getMessage().split("(")[1] for r in logged] == [
        "1 so far)",
        "2 so far)",
        "3 so far)",
        "4 so far)",
        "8 so far)",
    ]
    assert all(r.exc_info for r in logged)  # with the traceback


def test_a_round_that_returns_false_ends_the_thread():
    service = Counting(end_at=3).start()
    _wait_for(lambda: not service.running)
    assert service.rounds == 3 and service.stop()


def test_where_a_failure_means_what_it_watched_is_gone_it_ends_the_thread_with_a_warning(caplog):
    service = Counting(fail={2})
    service.ends_on_error = True
    with caplog.at_level(logging.WARNING, logger="meshscope.service"):
        service.start()
        _wait_for(lambda: not service.running)
    assert service.rounds == 2 and service.failures == 1
    assert [r.getMessage() for r in caplog.records] == ["meshscope-test-service stopped: round 2 broke"]


def test_stop_waits_a_bounded_time_and_says_whether_the_thread_ended():
    stuck = Counting(slow_s=3.0).start()
    _wait_for(lambda: stuck.rounds >= 1)
    started = time.monotonic()
    assert stuck.stop() is False  # still inside its 3 s round
    assert time.monotonic() - started < 2.0
    _wait_for(lambda: not stuck.running)


def test_a_stopped_service_starts_again_and_start_twice_is_one_thread():
    service = Counting()
    service.start()
    service.start()
    assert sum(t.name == "meshscope-test-service" for t in threading.enumerate()) == 1
    assert service.stop()
    before = service.rounds
    service.start()
    _wait_for(lambda: service.rounds > before)
    assert service.stop()
    assert not any(t.name == "meshscope-test-service" for t in threading.enumerate())


def test_a_forked_child_holds_no_thread_of_its_parent_and_may_start_its_own():
    service = Counting().start()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its copy of the service is stopped, startable, stoppable
        ok = not service.running and service.stop()
        service.start()
        before = service.rounds
        deadline = time.monotonic() + 5
        while service.rounds == before and time.monotonic() < deadline:
            time.sleep(0.005)
        ok = ok and service.rounds > before and service.stop()
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.waitpid(pid, 0)
    assert service.running and service.stop()


class Woken(Service):
    """A long interval: a round comes from `wake()` (a flush), and the last one from `stop()`."""

    def __init__(self) -> None:
        super().__init__("meshscope-test-woken", 3600.0, join_s=5.0)
        self.rounds, self.after = 0, 0

    def round(self) -> None:
        self.rounds += 1

    def after_rounds(self) -> None:
        self.after += 1


def test_a_wake_runs_a_round_now_and_a_stop_runs_the_last_one_once():
    service = Woken().start()
    time.sleep(0.2)
    assert service.rounds == 0  # an hour's interval: nothing yet
    service.wake()
    _wait_for(lambda: service.rounds == 1)
    started = time.monotonic()
    assert service.stop() and not service.running
    assert time.monotonic() - started < 2.0  # woken to stop, not after the interval
    assert (service.rounds, service.after) == (1, 1)
