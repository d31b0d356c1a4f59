"""The Monitor's drain: records a batch at a time (`record_every_s`), the flight log's step ends
every round (`drain_interval_s`), the store committed by the same thread."""

import contextlib
import time

import pytest
import torch
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
        assert _wait_for(lambda: read_flight(flight, last=0).step_s > 0), "the typical step not written"
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


@pytest.mark.parametrize("native", [True, False], ids=["C", "Python"])
def test_a_steps_end_writes_its_progress_without_waiting_for_a_round(tmp_path, monkeypatch, native):
    """The hang watchdog's progress is written as a step ends, in C and in Python, not by the
    drain's next round (`drain_interval_s`): a watchdog reads it as fresh as the step."""
    from meshscope.collector import comm, flightlog, monitor

    if not native:
        for module in (comm, flightlog, monitor):
            monkeypatch.setattr(module, "_fast", None)
    rounds = {"drain_interval_s": 60, "record_every_s": 60}  # no round comes in this test
    config = MonitorConfig(run_dir=tmp_path / "run", metrics_port=None, **rounds)
    mon = Monitor(config, registry=CollectorRegistry())
    try:
        model = mon.watch(torch.nn.Linear(2, 2))  # a host model: C may take its steps
        kinds = []
        for i in range(3):  # the first step describes the run in Python: C takes the next
            before = time.time()
            with mon.step(tokens=8) as scope:
                kinds.append(type(scope).__name__)
                model(torch.ones(1, 2))
            head = read_flight(mon.flight.path, last=0)
            assert head.device_step == i
            assert before <= head.progress_t <= time.time()
        assert ("Steps" in kinds) is native, kinds
        assert head.step_s == 0.0  # the typical step time is the drain's: no round came
    finally:
        mon.close()


def _ddp_steps_then_stacks(rank: int, world_size: int, run_dir: str) -> tuple[list, list]:
    """Three DDP steps with no round to come, then the watchdog's stacks request: the flight
    log's DDP reductions before and after it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from meshscope.collector.env import DistEnv

    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size)
    rounds = {"drain_interval_s": 60, "record_every_s": 60}
    mon = Monitor(MonitorConfig(run_dir=run_dir, metrics_port=None, **rounds), env=env)
    ddp = mon.watch(DDP(torch.nn.Linear(2, 2)))
    for _ in range(3):  # the first step describes the run in Python: C takes the next two
        with mon.step(tokens=2):
            ddp(torch.ones(1, 2)).sum().backward()

    def reductions() -> list:
        return [(r.step, r.state) for r in read_flight(mon.flight.path).records if "DDP" in r.site]

    before = reductions()
    mon.flight.write_stacks("probe")
    after = reductions()
    mon.close()
    return before, after


def test_a_stacks_request_writes_the_records_and_step_ends_queued_for_the_next_round(tmp_path):
    """C leaves DDP's reduction record and the step's end to the drain's round; a watchdog that
    asks for stacks reads them after its request, so they are written for it then, not a
    round later (`drain_interval_s`)."""
    from fixtures.dist import run_ranks

    ((before, after),) = run_ranks(_ddp_steps_then_stacks, 1, run_dir=str(tmp_path))
    assert len(before) < 3, before  # C's records wait for a round: none came
    assert after == [(0, "completed"), (1, "completed"), (2, "completed")]
