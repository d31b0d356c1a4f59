"""Ascend readiness without hardware: the NPU path against a stand-in `torch.npu` that records
every call, the way torch_npu exposes it (set_device, synchronize, Event, memory counters)."""

import time
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry

from meshscope.collector import Monitor, MonitorConfig
from meshscope.collector.store import load_steps
from meshscope.trainer import device as devmod
from meshscope.trainer.device import (
    AcceleratorProbe,
    DeviceUnavailable,
    backend_environment,
    check_placement,
    resolve_device,
)


class StandInNpu:
    """Records calls; events complete when recorded (an idle device)."""

    def __init__(self, count=2):
        self.calls = []
        self.count = count
        npu = self

        class Event:
            def __init__(self, enable_timing=False):
                npu.calls.append("Event")
                self.t = None

            def record(self, stream=None):
                npu.calls.append("Event.record")
                self.t = time.perf_counter()

            def query(self):
                npu.calls.append("Event.query")
                return self.t is not None

            def synchronize(self):
                npu.calls.append("Event.synchronize")

            def elapsed_time(self, end):
                npu.calls.append("Event.elapsed_time")
                return (end.t - self.t) * 1000.0

        self.Event = Event

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append(name)
            return {
                "device_count": self.count,
                "is_available": True,
                "is_initialized": False,
                "memory_allocated": 1 << 20,
                "memory_reserved": 2 << 20,
            }.get(name)

        return call


@pytest.fixture
def npu(monkeypatch):
    stand_in = StandInNpu()
    monkeypatch.setattr(devmod, "_torch_npu", lambda: SimpleNamespace())
    monkeypatch.setattr(torch, "npu", stand_in, raising=False)
    return stand_in


def test_npu_resolves_with_hccl_and_its_index(npu):
    d = resolve_device("npu", local_rank=3)
    assert (d.kind, d.backend, d.index) == ("npu", "hccl", 1)
    assert resolve_device("auto").kind == "npu"
    assert resolve_device("npu", backend="gloo").backend == "gloo"
    with pytest.raises(DeviceUnavailable, match="--backend nccl: cannot carry npu tensors"):
        resolve_device("npu", backend="nccl")


def test_more_ranks_than_npus_on_hccl_is_a_clear_error(npu):
    with pytest.raises(DeviceUnavailable, match="--nproc 4 on hccl needs 4 visible npu devices, 2"):
        check_placement("npu", "hccl", 4)
    check_placement("npu", "hccl", 2)
    check_placement("npu", "gloo", 8)  # gloo shares devices


def test_activate_and_synchronize_go_to_torch_npu(npu):
    d = resolve_device("npu", local_rank=1)
    d.activate()
    d.synchronize()
    assert "set_device" in npu.calls and "synchronize" in npu.calls


def test_monitor_on_npu_events_reads_without_waiting(tmp_path, npu):
    probe = resolve_device("npu").probe()
    assert isinstance(probe, AcceleratorProbe)
    mon = Monitor(
        MonitorConfig(run_dir=tmp_path / "r", metrics_port=None, sync_every=3),
        probe=probe,
        registry=CollectorRegistry(),
    )
    for _ in range(3):
        with mon.step(tokens=4) as s:
            with s.phase("forward"):
                time.sleep(0.002)
    mon.store.flush()
    steps = load_steps(tmp_path / "r")
    assert len(steps) == 3 and (steps["forward_s"] >= 0.002).all()
    assert steps["mem_allocated"].eq(1 << 20).all() and steps["mem_reserved"].eq(2 << 20).all()
    assert "Event.query" in npu.calls and "Event.synchronize" not in npu.calls
    mon.close()


def test_hccl_timeouts_reach_the_workers():
    env = backend_environment("npu", "hccl", timeout_s=120)
    assert env["HCCL_CONNECT_TIMEOUT"] == env["HCCL_EXEC_TIMEOUT"] == "120"
    assert "GLOO_SOCKET_IFNAME" not in env
    assert backend_environment("npu", "gloo")["GLOO_SOCKET_IFNAME"] == "lo"
