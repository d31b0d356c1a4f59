"""Device resolution, the same on any machine: what is visible is stubbed, never assumed."""

import pytest

from meshscope import launcher
from meshscope.collector.probe import HostProbe
from meshscope.config import RunConfig
from meshscope.trainer import device as devmod
from meshscope.trainer.device import Device, DeviceUnavailable, backend_environment, resolve_device


@pytest.fixture(autouse=True)
def a_host_without_accelerators(monkeypatch):
    """A GPU or NPU on the test machine must not change what these tests see."""
    monkeypatch.setattr(devmod, "cuda_count", lambda: 0)
    monkeypatch.setattr(devmod, "_torch_npu", lambda: None)


def test_auto_picks_cpu_with_gloo_without_accelerators():
    d = resolve_device("auto")
    assert (d.kind, d.backend) == ("cpu", "gloo")
    assert isinstance(d.probe(), HostProbe)


def test_npu_without_torch_npu_is_a_clear_error():
    with pytest.raises(DeviceUnavailable, match="torch_npu is not importable"):
        resolve_device("npu")


def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(DeviceUnavailable, match="no cuda device"):
        resolve_device("cuda")


def test_sim_is_chosen_only_by_name_and_runs_simnccl():
    assert resolve_device("auto").kind == "cpu"
    d = resolve_device("sim", local_rank=2)
    assert (d.kind, d.backend, d.index, d.on_host) == ("sim", "simnccl", 2, True)
    assert resolve_device("sim", backend="simhccl").backend == "simhccl"
    with pytest.raises(DeviceUnavailable, match="--backend nccl: cannot carry sim tensors"):
        resolve_device("sim", backend="nccl")


def test_npu_is_preferred_when_present(monkeypatch):
    monkeypatch.setattr(devmod, "npu_count", lambda: 8)
    monkeypatch.setattr(devmod, "_torch_npu", lambda: object())
    d = resolve_device("auto", local_rank=11)
    assert (d.kind, d.backend, d.index) == ("npu", "hccl", 3)


def test_nccl_workers_keep_the_flight_recorder_with_timing_unless_the_user_said_otherwise(monkeypatch):
    """Without a ring nothing is recorded; without timing no entry is ever "started"."""
    env = backend_environment("cuda")
    assert env["TORCH_FR_BUFFER_SIZE"] == env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert env["TORCH_NCCL_ENABLE_TIMING"] == "1"
    assert "TORCH_NCCL_ENABLE_TIMING" not in backend_environment("cpu")
    monkeypatch.setattr(launcher, "resolve_device", lambda *a, **k: Device("cuda", backend="nccl"))
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")  # the user turned it off: it stays off
    assert launcher.worker_environment(RunConfig(device="cpu"))["TORCH_FR_BUFFER_SIZE"] == "0"


def test_backend_environment_is_the_librarys_not_the_networks():
    assert "GLOO_SOCKET_IFNAME" not in backend_environment("cpu")  # trainer.network decides
    assert backend_environment("npu", timeout_s=120)["HCCL_CONNECT_TIMEOUT"] == "120"
