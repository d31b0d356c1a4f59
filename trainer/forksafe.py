"""Fork safety: a process that forks workers (the warm standby) must never touch an accelerator.

CUDA and Ascend's runtime cannot be used in a child forked after the parent initialised them
("Cannot re-initialize CUDA in forked subprocess"). Even a device *count* through the runtime
(`cudaGetDeviceCount`, what `torch.cuda.is_available()` calls unless
`PYTORCH_NVML_BASED_CUDA_CHECK=1`) poisons later forks. Three layers keep the zygote honest:

- `AcceleratorTripwire` wraps the runtime entry points (lazy init, device count) of
  `torch.cuda` and `torch.npu`, records the first call site, and in strict mode raises, so a
  test fails the moment the warm-up touches a device;
- `fork_hazard()` asks the runtimes themselves before every fork (`is_initialized()`);
- `probe_fork()` forks a throw-away child that starts each runtime with a device for real,
  which catches what no Python wrapper sees: a C++ path that initialised the driver (the
  autograd engine's first backward counts every device type's devices) marks no "bad fork",
  yet the child's start fails with "initialization error" (seen on an H200, torch 2.11).

Each returns a sentence naming the cause, or None when forking is safe.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"

# (module attribute path, function name): the entry points that initialise a device runtime.
_ENTRY_POINTS = (
    ("cuda", "_lazy_init"),
    ("cuda", "init"),
    ("_C", "_cuda_getDeviceCount"),
    ("_C", "_cuda_init"),
    ("npu", "_lazy_init"),
    ("npu", "init"),
)


class AcceleratorTouched(RuntimeError):
    """Raised in strict mode when code in a forking process initialises an accelerator."""


def _accelerator_modules() -> list[tuple[str, Any]]:
    import torch

    mods = [("cuda", torch.cuda)]
    npu = getattr(torch, "npu", None)  # present once torch_npu was imported (or autoloaded)
    if npu is not None:
        mods.append(("npu", npu))
    return mods


class AcceleratorTripwire:
    """Wraps device-runtime entry points; remembers (and in strict mode refuses) the first use."""

    def __init__(self, *, strict: bool = False) -> None:
        self.strict = strict
        self.touched: str | None = None
        self._undo: list[Callable[[], None]] = []

    def install(self) -> AcceleratorTripwire:
        """Make any accelerator initialisation raise (before a fork)."""
        import torch

        owners = {"cuda": torch.cuda, "_C": torch._C, "npu": getattr(torch, "npu", None)}
        for owner_name, fn_name in _ENTRY_POINTS:
            owner = owners.get(owner_name)
            original = getattr(owner, fn_name, None) if owner is not None else None
            if original is None:
                continue
            setattr(owner, fn_name, self._wrap(f"torch.{owner_name}.{fn_name}", original))
            self._undo.append(lambda o=owner, n=fn_name, f=original: setattr(o, n, f))
        return self

    def uninstall(self) -> None:
        """Put the accelerator entry points back."""
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def tripwire(*args: Any, **kwargs: Any) -> Any:
            if self.touched is None:
                site = "".join(traceback.format_stack(limit=6)[:-1]).strip()
                self.touched = f"{name} was called in a process that forks workers:\n{site}"
            if self.strict:
                raise AcceleratorTouched(self.touched)
            return original(*args, **kwargs)

        return tripwire


def fork_hazard(tripwire: AcceleratorTripwire | None = None) -> str | None:
    """Why forking now would break the child's accelerator, or None when it is safe."""
    if tripwire is not None and tripwire.touched:
        return tripwire.touched
    for kind, module in _accelerator_modules():
        initialised = getattr(module, "is_initialized", None)
        if initialised is not None and initialised():
            return f"torch.{kind} is initialised in the forking process"
    return None


def in_bad_fork() -> str | None:
    """In a forked child: which runtime refuses to start here, if any (one with a device is
    started: only that shows a driver the parent initialised below Python)."""
    for kind, module in _accelerator_modules():
        bad = getattr(module, "_is_in_bad_fork", None)
        if bad is not None and bad():
            return kind
        count, start = getattr(module, "device_count", None), getattr(module, "init", None)
        if count is None or start is None:
            continue
        try:
            if count() > 0:  # through NVML where the zygote asked for it: no init
                start()
        except Exception:  # noqa: BLE001  (the runtime's own error: this fork cannot use it)
            return kind
    return None


def probe_fork(tripwire: AcceleratorTripwire | None = None) -> str | None:
    """Fork a throw-away child and ask whether its accelerator runtime would start.

    Catches runtime initialisation that happened below Python (no tripwire sees it). The
    child lifts `tripwire`, as a worker does: starting its device is the test."""
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code only, never run cleanup handlers
        if tripwire is not None:
            tripwire.uninstall()
        os._exit(3 if in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return None
    return (
        "a forked child cannot use its accelerator (the parent initialised the device runtime below Python)"
    )


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel for `sig` when this process's parent dies, SIGKILL included: what
    meshscope starts (torchrun, the warm standby, workers) never outlives its starter under
    PID 1. SIGKILL, not SIGTERM: a starter that died abruptly leaves nobody to stop in order,
    and a graceful stop would tell the peers "departed" where the node is gone. Call it in the
    child (a Popen `preexec_fn`, right after a fork, or first thing in a process)."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
