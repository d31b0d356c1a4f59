"""The Monitor never waits for the device: records come out once their events say so.

A stand-in device (events the test completes by hand) drives the Monitor's accelerator path on
the CPU: logged scalars go through the window buffer and the non-blocking read-back, timing
marks are events, and nothing may call `synchronize()` except flush/close.
"""

import threading
import time

import pytest
import torch
from prometheus_client import CollectorRegistry

from meshscope.collector import Monitor, MonitorConfig, readback
from meshscope.collector.store import load_steps


class StandInEvent:
    """A device event: done only when the test says so; counts blocking waits."""

    created: list["StandInEvent"] = []
    waits = 0

    def __init__(self):
        self.done = False
        self.t = time.perf_counter()
        StandInEvent.created.append(self)

    def query(self):
        return self.done

    def synchronize(self):
        StandInEvent.waits += 1
        self.done = True


class StandInProbe:
    asynchronous = True

    def mark(self):
        return StandInEvent()

    def ready(self, mark):
        return mark.query()

    def wait(self, mark):
        mark.synchronize()

    def seconds(self, start, end):
        assert start.done and end.done, "read an unfinished mark: that would block"
        return end.t - start.t

    def memory(self):
        return {"allocated": 7, "reserved": 8, "rss": 9}


@pytest.fixture
def stand_in_device(monkeypatch):
    StandInEvent.created, StandInEvent.waits = [], 0
    monkeypatch.setattr(readback, "is_device_tensor", lambda v: isinstance(v, torch.Tensor))
    monkeypatch.setattr(readback, "device_event", lambda device: StandInEvent())


def finish_device_work():
    for e in StandInEvent.created:
        e.done = True


def drained(mon, count, timeout_s=20.0):
    """The steps in the store once the service thread has emitted `count` (or the time is up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        mon.store.flush()
        steps = load_steps(mon.config.run_dir)["step"].tolist()
        if len(steps) >= count or time.monotonic() > deadline:
            return steps
        time.sleep(0.05)


def test_steps_wait_for_their_events_without_blocking(tmp_path, stand_in_device):
    mon = Monitor(
        MonitorConfig(run_dir=tmp_path / "r", metrics_port=None, sync_every=4),
        probe=StandInProbe(),
        registry=CollectorRegistry(),
    )
    for step in range(10):
        with mon.step(tokens=8) as s:
            with s.phase("forward"):
                pass
            s.log(loss=torch.tensor(float(step)), grad_norm=torch.tensor(2.0 * step))
    mon.store.flush()
    assert load_steps(tmp_path / "r").empty  # the device has finished nothing yet
    finish_device_work()  # windows 0-3 and 4-7 landed; steps 8-9 are in the open window
    with mon.step(tokens=8) as s:
        s.log(loss=torch.tensor(10.0))
    # the Monitor's service thread emits them, without the training thread
    assert drained(mon, 8) == list(range(8))
    assert StandInEvent.waits == 0
    mon.close()  # the only place that waits
    steps = load_steps(tmp_path / "r")
    assert steps["step"].tolist() == list(range(11))
    assert steps["loss"].tolist() == [float(i) for i in range(11)]
    assert steps["grad_norm"].tolist()[:10] == [2.0 * i for i in range(10)]
    assert steps["mem_allocated"].eq(7).all()
    assert StandInEvent.waits > 0


def test_one_read_back_per_window(tmp_path, stand_in_device):
    mon = Monitor(
        MonitorConfig(run_dir=tmp_path / "r", metrics_port=None, sync_every=5),
        probe=StandInProbe(),
        registry=CollectorRegistry(),
    )
    reads = []
    real = readback.Readback.__init__

    def counting(self, tensor, **kwargs):
        reads.append(tensor.numel())
        real(self, tensor, **kwargs)

    readback.Readback.__init__ = counting
    try:
        for _ in range(15):
            with mon.step() as s:
                s.log(loss=torch.tensor(1.0), grad_norm=torch.tensor(1.0))
    finally:
        readback.Readback.__init__ = real
    assert reads == [10, 10, 10]  # 5 steps x 2 scalars in each copy
    mon.close()


def test_host_steps_go_out_on_the_service_thread_not_the_training_thread(tmp_path):
    mon = Monitor(
        MonitorConfig(run_dir=tmp_path / "r", metrics_port=None, sync_every=3, drain_interval_s=0.05),
        registry=CollectorRegistry(),
    )
    emitted_on = set()
    add_step = mon.store.add_step

    def noting(rec):
        emitted_on.add(threading.current_thread().name)
        add_step(rec)

    mon.store.add_step = noting
    for step in range(4):
        with mon.step() as s:
            s.log(loss=torch.tensor(float(step)))
    assert drained(mon, 4) == [0, 1, 2, 3]  # no flush, no window's end: the service's round
    assert emitted_on == {"meshscope-monitor"}
    assert mon.metrics.steps._value.get() == 4
    mon.close()
    assert load_steps(tmp_path / "r")["loss"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert not mon._service.running


def test_scalar_window_gathers_and_reads_back():
    w = readback.ScalarWindow()
    a = w.add([torch.tensor(1.0), torch.tensor(2.0)])
    b = w.add([torch.tensor(3.0)])
    assert not w.ready()  # open: nothing copied yet
    w.close()
    assert w.ready() and w.values(a, 2) == [1.0, 2.0] and w.values(b, 1) == [3.0]


def test_a_host_tensor_is_copied_unless_its_owner_hands_it_over():
    """A host value is ready at once; a copy keeps it from later writes, unless the caller
    says nothing writes it (a window's fresh sum: no copy a window)."""
    tensor = torch.tensor([1, 2])
    copied, kept = readback.Readback(tensor), readback.Readback(tensor, owned=True)
    tensor.add_(10)
    assert copied.ready() and copied.value().tolist() == [1, 2]
    assert kept.value().tolist() == [11, 12]  # the same storage, not a copy
