import pytest

from meshscope.collector.probe import HostProbe
from meshscope.trainer import device as devmod
from meshscope.trainer.device import DeviceUnavailable, backend_environment, resolve_device


def test_auto_picks_cpu_with_gloo_here():
    d = resolve_device("auto")
    assert (d.kind, d.backend) == ("cpu", "gloo")
    assert isinstance(d.probe(), HostProbe)


def test_npu_without_torch_npu_is_a_clear_error():
    with pytest.raises(DeviceUnavailable, match="torch_npu is not importable"):
        resolve_device("npu")


def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(DeviceUnavailable, match="no cuda device"):
        resolve_device("cuda")


def test_npu_is_preferred_when_present(monkeypatch):
    monkeypatch.setattr(devmod, "npu_count", lambda: 8)
    monkeypatch.setattr(devmod, "_torch_npu", lambda: object())
    d = resolve_device("auto", local_rank=11)
    assert (d.kind, d.backend, d.index) == ("npu", "hccl", 3)


def test_backend_environment():
    assert backend_environment("cpu")["GLOO_SOCKET_IFNAME"] == "lo"
    assert backend_environment("npu", timeout_s=120)["HCCL_CONNECT_TIMEOUT"] == "120"
