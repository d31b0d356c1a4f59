"""The device layer: the one place that knows npu/cuda/cpu, their backends, timing and memory.

`npu` (Ascend, torch_npu, hccl) when torch_npu imports and a device is there, else `cuda`
(nccl), else `cpu` (gloo). Everything else in the trainer asks this module.

The backend defaults to the device's own (hccl, nccl, gloo); gloo may also carry accelerator
tensors, which is how several ranks share one device (nccl and hccl refuse two ranks on one
device). Ascend mirrors CUDA here: events, memory, set_device, synchronize through `torch.npu`.
`sim` is a simulated accelerator on the CPU (`trainer.sim`): never picked by `auto`, it gives
a CPU run the semantics of a device stream, with the `simnccl`/`simhccl` backends.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from meshscope.collector.probe import HostProbe, host_rss_bytes
from meshscope.trainer import sim

BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo", "sim": "simnccl"}
# Backends that can carry each device's tensors.
COMPATIBLE = {
    "npu": ("hccl", "gloo"),
    "cuda": ("nccl", "gloo"),
    "cpu": ("gloo",),
    "sim": ("simnccl", "simhccl", "gloo"),
}


class DeviceUnavailable(RuntimeError):
    """The requested device cannot be used here; the message says why."""


def _torch_npu() -> Any | None:
    """Import torch_npu if it works. It raises RuntimeError, not only ImportError, without CANN."""
    try:
        return importlib.import_module("torch_npu")
    except (ImportError, RuntimeError, OSError):
        return None


def npu_count() -> int:
    """Ascend NPUs visible through torch_npu (0 without it)."""
    if _torch_npu() is None:
        return 0
    npu = getattr(torch, "npu", None)
    return int(npu.device_count()) if npu is not None and npu.is_available() else 0


def cuda_count() -> int:
    """CUDA devices visible (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class Device:
    """This worker's device and the collective backend its default process group uses."""

    kind: str
    index: int = 0
    backend: str = ""

    def __post_init__(self) -> None:
        if not self.backend:
            object.__setattr__(self, "backend", BACKENDS[self.kind])

    @property
    def torch_device(self) -> torch.device:
        """The torch.device of this rank (the sim's device is the host)."""
        return torch.device("cpu") if self.kind in ("cpu", "sim") else torch.device(self.kind, self.index)

    @property
    def on_host(self) -> bool:
        """Tensors live in host memory (cpu and the sim)."""
        return self.kind in ("cpu", "sim")

    def activate(self) -> None:
        """Bind this process to its device (before building the model or the process group)."""
        if self.kind == "sim":
            sim.register_backends()
        if self.kind != "cpu":
            accelerator_module(self.kind).set_device(self.index)

    def upload(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor onto this device without blocking the host (pinned, non-blocking)."""
        if self.on_host:
            return tensor
        return tensor.pin_memory().to(self.torch_device, non_blocking=True)

    def synchronize(self) -> None:
        """Wait for the device: the only explicit sync in the trainer (checkpoints, benchmarks)."""
        if self.kind != "cpu":
            accelerator_module(self.kind).synchronize(self.index)  # sync point

    def probe(self) -> Any:
        """Timing and memory for the Monitor: events on accelerators, perf_counter on the host."""
        return HostProbe() if self.kind == "cpu" else AcceleratorProbe(self)


def accelerator_module(kind: str) -> Any:
    """The module that drives a device kind: torch.cuda, torch.npu, or the sim."""
    if kind == "sim":
        return sim.SIM
    return torch.cuda if kind == "cuda" else torch.npu  # type: ignore[attr-defined]


class AcceleratorProbe:
    """Device events as time marks: recorded without blocking, read once `query()` says done."""

    asynchronous = True

    def __init__(self, device: Device) -> None:
        self._module = accelerator_module(device.kind)
        self._index = device.index
        self.kind = device.kind  # what an SDK run's run_start names

    def bind(self) -> None:
        """Make the calling thread's current device this rank's. The current device is per
        thread and a new thread's is 0: the device-truth thread's first event query would
        otherwise make a context on device 0 for every rank of the node (~0.5 GiB each)."""
        self._module.set_device(self._index)

    def mark(self) -> Any:
        """Record an event on the current stream."""
        event = self._module.Event(enable_timing=True)
        event.record()
        return event

    def ready(self, mark: Any) -> bool:
        """Whether the device has passed `mark` (event query, no sync)."""
        return bool(mark.query())

    def wait(self, mark: Any) -> None:
        """Block until the device has passed `mark`."""
        mark.synchronize()  # sync point: the Monitor's flush and close only

    def seconds(self, start: Any, end: Any) -> float:
        """Both marks must be ready (the Monitor checks): elapsed_time then does not wait."""
        return max(0.0, start.elapsed_time(end) / 1000.0)

    def memory(self) -> dict[str, int]:
        """The device's allocated and reserved bytes, and host RSS."""
        return {
            "allocated": int(self._module.memory_allocated(self._index)),
            "reserved": int(self._module.memory_reserved(self._index)),
            "rss": host_rss_bytes(),
        }


def available_kinds() -> list[str]:
    """The device kinds this machine has, best first."""
    kinds = []
    if npu_count():
        kinds.append("npu")
    if cuda_count():
        kinds.append("cuda")
    return kinds + ["cpu"]


def resolve_backend(kind: str, requested: str = "auto") -> str:
    """The backend for `kind`: its own by default; an incompatible request is a clear error."""
    if requested == "auto":
        return BACKENDS[kind]
    if requested not in COMPATIBLE[kind]:
        raise DeviceUnavailable(
            f"--backend {requested}: cannot carry {kind} tensors (use {' or '.join(COMPATIBLE[kind])})"
        )
    return requested


def device_count(kind: str) -> int:
    """Visible devices of a kind (the host counts as one)."""
    return {"npu": npu_count, "cuda": cuda_count, "sim": sim.SIM.device_count}.get(kind, lambda: 1)()


def check_placement(kind: str, backend: str, nproc: int) -> None:
    """nccl and hccl need a device per rank on this node; say so before anything starts."""
    if backend not in ("nccl", "hccl"):
        return
    count = device_count(kind)
    if nproc > count:
        raise DeviceUnavailable(
            f"--nproc {nproc} on {backend} needs {nproc} visible {kind} devices, {count} "
            f"{'is' if count == 1 else 'are'} visible ({backend} refuses two ranks on one "
            f"device): use --nproc {count}, or --backend gloo to share devices"
        )


def resolve_device(requested: str = "auto", local_rank: int = 0, backend: str = "auto") -> Device:
    """Pick the device for this worker; an unavailable explicit request is a clear error."""
    if requested == "auto":
        requested = available_kinds()[0]
    if requested in ("cpu", "sim"):
        return Device(requested, local_rank % device_count(requested), resolve_backend(requested, backend))
    if requested == "npu":
        if _torch_npu() is None:
            raise DeviceUnavailable(
                "--device npu: torch_npu is not importable here (install torch_npu with Ascend's "
                "CANN toolkit, or use --device cpu / cuda)"
            )
        count = npu_count()
    elif requested == "cuda":
        count = cuda_count()
    else:
        raise DeviceUnavailable(f"--device {requested}: unknown device (npu, cuda, cpu, sim or auto)")
    if count == 0:
        raise DeviceUnavailable(f"--device {requested}: no {requested} device is visible")
    return Device(requested, local_rank % count, resolve_backend(requested, backend))


# How long a collective may wait for its peers before the collective library gives up.
COLLECTIVE_TIMEOUT_S = 600
# torch_npu: the process group's timeout must be larger than HCCL's own (HCCL_EXEC_TIMEOUT,
# HCCL_CONNECT_TIMEOUT), so that HCCL's error, which names the stuck operation, comes first.
PG_TIMEOUT_MARGIN_S = 60
# Atlas training (and 300I Duo) parts round HCCL_EXEC_TIMEOUT *down* to a multiple of 68 s
# (68 s at least, 17340 s at most); A2/A3 parts take the value as given.
HCCL_EXEC_STEP_S, HCCL_EXEC_MAX_S = 68, 17340


def hccl_exec_timeout_s(requested: int) -> int:
    """The execution timeout an Atlas training part really applies for `requested` seconds."""
    return min(HCCL_EXEC_MAX_S, max(HCCL_EXEC_STEP_S, requested // HCCL_EXEC_STEP_S * HCCL_EXEC_STEP_S))


def process_group_timeout_s(kind: str, timeout_s: int = COLLECTIVE_TIMEOUT_S) -> int:
    """The `init_process_group` timeout: on Ascend above HCCL's own timeouts (see above)."""
    return timeout_s + PG_TIMEOUT_MARGIN_S if kind == "npu" else timeout_s


FLIGHT_RECORDER_ENV = {
    "TORCH_FR_BUFFER_SIZE": "2000",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_NCCL_ENABLE_TIMING": "1",
}
# torch_npu's Flight Recorder for HCCL, under its own names (its tests set these two)
HCCL_FLIGHT_RECORDER_ENV = {"TORCH_HCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_HCCL_ENABLE_TIMING": "1"}


def backend_environment(
    kind: str, backend: str = "", *, timeout_s: int = COLLECTIVE_TIMEOUT_S
) -> dict[str, str]:
    """Environment the launcher gives workers for this device's collective library (where
    gloo talks, and OMP's threads, are the network's business: `trainer.network`)."""
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    if kind == "npu" and (backend or BACKENDS[kind]) == "hccl":
        env["HCCL_CONNECT_TIMEOUT"] = str(timeout_s)
        # a multiple of 68 s, so that every Atlas part applies the value written here
        env["HCCL_EXEC_TIMEOUT"] = str(hccl_exec_timeout_s(timeout_s))
        env.update(HCCL_FLIGHT_RECORDER_ENV)  # as NCCL's below
    elif kind == "cuda":
        env["TORCH_NCCL_BLOCKING_WAIT"] = "0"
        # NCCL's own Flight Recorder, with timing: without a ring nothing is kept, and without
        # timing no entry is ever "started", so a stuck collective's culprit cannot be read
        # from the dumps (both names of the ring's size: PyTorch renamed it in 2.6)
        env.update(FLIGHT_RECORDER_ENV)
    return env
