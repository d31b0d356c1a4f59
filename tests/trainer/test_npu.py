"""Ascend readiness without hardware: the NPU path against a stand-in `torch.npu` that answers
only the names torch's device modules have, with device semantics (the sim's events complete
when its stream gets there, not when recorded), and records every call."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry

from meshscope.collector import Monitor, MonitorConfig
from meshscope.collector.store import load_steps
from meshscope.trainer import device as devmod
from meshscope.trainer import sim
from meshscope.trainer.device import (
    AcceleratorProbe,
    DeviceUnavailable,
    backend_environment,
    check_placement,
    hccl_exec_timeout_s,
    process_group_timeout_s,
    resolve_device,
)


def public_names(cls):
    return sorted(n for n in vars(cls) if not n.startswith("_"))


class RecordingNpu:
    """`torch.npu` as the sim answers it, every call recorded ("Event.query" for methods)."""

    def __init__(self, count=2):
        self._sim = sim.SimAccelerator(count=count)
        self.calls = []
        calls = self.calls

        class Event(sim.SimEvent):
            def __init__(self, *args, **kwargs):
                calls.append("Event")
                super().__init__(*args, **kwargs)

        for name in public_names(sim.SimEvent):

            def recorded(self, *args, _name=name, **kwargs):
                calls.append(f"Event.{_name}")
                return getattr(sim.SimEvent, _name)(self, *args, **kwargs)

            setattr(Event, name, recorded)
        self.Event = Event

    def __getattr__(self, name):
        target = getattr(self._sim, name)  # AttributeError: torch.npu has no such name either

        def call(*args, **kwargs):
            self.calls.append(name)
            return target(*args, **kwargs)

        return call


@pytest.fixture
def npu(monkeypatch):
    stand_in = RecordingNpu()
    monkeypatch.setattr(devmod, "_torch_npu", lambda: SimpleNamespace())
    monkeypatch.setattr(torch, "npu", stand_in, raising=False)
    return stand_in


def test_the_stand_in_answers_only_names_the_real_device_modules_have():
    # torch_npu mirrors torch.cuda's names; torch.cuda is importable everywhere
    for name in public_names(sim.SimAccelerator):
        assert hasattr(torch.cuda, name), f"torch.cuda has no {name}: the sim must not either"
    for name in public_names(sim.SimEvent):
        assert hasattr(torch.cuda.Event, name), f"torch.cuda.Event has no {name}"
    with pytest.raises(AttributeError):
        sim.SIM.memory_allocated_bytes  # noqa: B018  (a plausible name no device module has)
    with pytest.raises(AttributeError):
        RecordingNpu().synchronise  # noqa: B018


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
    gate = threading.Event()
    sim.stream().enqueue(gate.wait)  # the device is busy: nothing recorded after this completes
    leak = []
    for step in range(3):
        with mon.step(tokens=4) as s:
            with s.phase("forward"):
                time.sleep(0.002)
                if step == 2:
                    leak.append(torch.ones(16 << 20))  # 64 MB the device keeps
    mon.store.flush()
    assert len(load_steps(tmp_path / "r")) == 0  # the steps wait for their events; the host did not
    assert "Event.synchronize" not in npu.calls
    gate.set()
    mon.flush()
    steps = load_steps(tmp_path / "r")
    # the host slept in forward while the device was busy elsewhere: device time is the
    # device's (its events all passed at once when it got there), not the host's sleep
    assert len(steps) == 3 and (steps["forward_s"] < 0.002).all(), steps["forward_s"].tolist()
    grown = steps["mem_allocated"].iloc[2] - steps["mem_allocated"].iloc[0]
    assert grown >= 32 << 20, steps["mem_allocated"].tolist()  # the device layer's figure, not a constant
    assert "Event.query" in npu.calls and "memory_allocated" in npu.calls
    mon.close()


def test_hccl_timeouts_reach_the_workers_below_the_process_groups():
    env = backend_environment("npu", "hccl", timeout_s=600)
    assert env["HCCL_CONNECT_TIMEOUT"] == "600"
    assert env["HCCL_EXEC_TIMEOUT"] == "544"  # 600 s on Atlas training parts is 8 x 68 s
    assert process_group_timeout_s("npu", 600) > 600
    assert "HCCL_EXEC_TIMEOUT" not in backend_environment("npu", "gloo")  # gloo: no HCCL
    # torch_npu's Flight Recorder keeps a ring with timing, as NCCL's does
    assert env["TORCH_HCCL_TRACE_BUFFER_SIZE"] == "2000" and env["TORCH_HCCL_ENABLE_TIMING"] == "1"
    assert [hccl_exec_timeout_s(s) for s in (1, 68, 135, 136, 10**6)] == [68, 68, 68, 136, 17340]
