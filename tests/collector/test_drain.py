"""The Monitor's drain: records a batch at a time (`record_every_s`), the flight log's step ends
every round (`drain_interval_s`), the store committed by the same thread."""

import contextlib
import time

from prometheus_client import CollectorRegistry

from meshscope.collector import Monitor, MonitorConfig
from meshscope.collector.flightread import read_flight
from meshscope.collector.store import load_events, load_steps


def _wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


@contextlib.contextmanager
def _three_steps(tmp_path, record_every_s: float):
    """A Monitor whose rounds come every 20 ms, after three finished steps; closed after."""
    config = MonitorConfig(
        run_dir=tmp_path / "run", metrics_port=None, drain_interval_s=0.02, record_every_s=record_every_s
    )
    mon = Monitor(config, registry=CollectorRegistry())
    try:
        for _ in range(3):
            with mon.step(tokens=8):
                pass
        yield mon
    finally:
        mon.close()


def test_records_wait_for_their_batch_while_the_flight_log_shows_progress_every_round(tmp_path):
    """Finished steps wait for the next batch (`record_every_s`); the hang watchdog's progress
    does not wait for them, and flush() records them at once."""
    with _three_steps(tmp_path, record_every_s=60) as mon:
        flight = mon.flight.path
        assert _wait_for(lambda: read_flight(flight, last=0).device_step == 2), "progress not written"
        assert read_flight(flight, last=0).progress_t > 0
        time.sleep(0.2)  # rounds went by: the steps wait for their batch
        assert len(mon._pending) == 3
        mon.flush()
        assert not mon._pending
        assert list(load_steps(mon.config.run_dir)["step"]) == [0, 1, 2]


def test_a_batch_is_recorded_and_committed_by_the_service_thread_without_a_flush(tmp_path):
    """The Monitor's store has no writer thread: its service thread commits what it recorded
    (and an event queued from another thread), and a reader sees them without a flush."""
    with _three_steps(tmp_path, record_every_s=0.3) as mon:
        assert mon.store._thread is None
        mon.event("info")
        assert _wait_for(lambda: list(load_steps(mon.config.run_dir)["step"]) == [0, 1, 2], timeout_s=5.0)
        assert "info" in list(load_events(mon.config.run_dir)["kind"])
