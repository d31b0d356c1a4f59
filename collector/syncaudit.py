"""Which host reads of tensor values happen during training steps, by call site.

meshscope promises never to stall the device: nothing it adds to a step makes the host wait
for a device value, except where it says so (`# sync point` on the line). `SyncAudit` checks
the promise the way `torch.cuda.set_sync_debug_mode` would, on any device, the simulated one
included: it wraps the tensor methods that read a value on the host (`item`, `tolist`,
`__bool__`, `__float__`, `__int__`, `__index__`, `numpy`, `cpu`), the copies that block the
host between host and device memory (`to` a device and `copy_` across devices, unless
`non_blocking=True`: PyTorch's blocking copy synchronises the stream) and the device modules'
`synchronize`, and counts each call by its call site (the first frame outside torch). A site
whose line says `# sync point` is a deliberate sync; one that says `# host tensor` reads a
tensor that lives in host memory by construction (the control plane's flags), which costs the
device nothing. Everything else is *unmarked*: a sync nobody owns.

Reads are attributed to the step the flight log says is running (none before the first). On
the simulated device every tensor is in host memory, so the audit cannot tell a host tensor
from a device one by itself: the marks say which is which.
"""

from __future__ import annotations

import functools
import json
import linecache
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu")
MARKS = {"# sync point": "sync point", "# host tensor": "host tensor"}
_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS = __file__


def _call_site(frame: Any) -> tuple[str, str]:
    """(where, what its line says) of the first frame outside torch and this module."""
    while frame is not None and (
        frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_filename == _THIS
    ):
        frame = frame.f_back
    if frame is None:
        return "?", ""
    path, line = frame.f_code.co_filename, frame.f_lineno
    above = linecache.getline(path, line - 1).strip()
    # the line's own mark, else a comment line right above it (a mark too long for the line)
    text = linecache.getline(path, line) + (above if above.startswith("#") else "")
    mark = next((name for tag, name in MARKS.items() if tag in text), "")
    return f"{'/'.join(path.rsplit('/', 2)[-2:])}:{line} {frame.f_code.co_name}", mark


def _target(args: tuple, kwargs: dict) -> torch.device | None:
    """The device a `Tensor.to(...)` call names, if any."""
    where = kwargs.get("device", args[0] if args else None)
    if isinstance(where, torch.Tensor):
        return where.device
    if isinstance(where, (torch.device, str, int)) and not isinstance(where, bool):
        return torch.device(where)
    return None


def blocking_to(host_is_device: bool, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
    """Whether `tensor.to(...)` blocks the host: a copy between host and device memory without
    `non_blocking=True` (a positional bool after the first argument is `non_blocking`)."""
    if kwargs.get("non_blocking") or any(a is True for a in args[1:]):
        return False
    where = _target(args, kwargs)
    if where is None:  # a dtype change stays where it is
        return False
    return where.type != tensor.device.type or (host_is_device and where.type == "cpu")


def blocking_copy_(
    host_is_device: bool, tensor: torch.Tensor, src: Any = None, *args: Any, **kwargs: Any
) -> bool:
    """Whether `tensor.copy_(src)` blocks the host: across host and device, not non-blocking."""
    if kwargs.get("non_blocking") or any(a is True for a in args) or not isinstance(src, torch.Tensor):
        return False
    return src.device.type != tensor.device.type


COPIES = {"to": blocking_to, "copy_": blocking_copy_}


class SyncAudit:
    """Counts host reads of tensor values in training steps (see the module doc)."""

    _active: SyncAudit | None = None

    def __init__(self, step_of: Any = None, host_is_device: bool = False) -> None:
        self.step_of = step_of or (lambda: 0)  # the running step (< 0: not in a step)
        self.host_is_device = host_is_device  # the sim: a copy "to the device" stays on the host
        self.unmarked: Counter[str] = Counter()
        self.marked: Counter[str] = Counter()
        self.steps: set[int] = set()
        self._originals: list[tuple[Any, str, Any]] = []
        self._inside = False

    def install(self, *modules: Any) -> SyncAudit:
        """Wrap the tensor reads and every given device module's `synchronize` (and its
        Event's), once per process."""
        SyncAudit._active = self
        for name in READS:
            self._wrap(torch.Tensor, name, f"Tensor.{name}")
        for name, syncs in COPIES.items():
            self._wrap(torch.Tensor, name, f"Tensor.{name}", syncs)
        for module in modules:
            if module is not None and hasattr(module, "synchronize"):
                self._wrap(module, "synchronize", "synchronize")
                event = getattr(module, "Event", None)
                if event is not None and hasattr(event, "synchronize"):
                    self._wrap(event, "synchronize", "Event.synchronize")
        return self

    def _wrap(self, owner: Any, name: str, label: str, syncs: Any = None) -> None:
        original = getattr(owner, name)
        audit = self

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            # a read inside a counted read is the same read; a copy that stays put is none
            if audit._inside or (syncs is not None and not audit._copies(syncs, args, kwargs)):
                return original(*args, **kwargs)
            audit._count(label, sys._getframe(1))
            audit._inside = True
            try:
                return original(*args, **kwargs)
            finally:
                audit._inside = False

        self._originals.append((owner, name, original))
        setattr(owner, name, counted)

    def _copies(self, syncs: Any, args: tuple, kwargs: dict) -> bool:
        """A blocking copy written outside torch: torch's own `.to(device)` calls (clipping's
        per-gradient coefficient) move tensors it knows are on the device already."""
        if sys._getframe(2).f_code.co_filename.startswith(_TORCH_DIR):
            return False
        return syncs(self.host_is_device, *args, **kwargs)

    def _count(self, label: str, frame: Any) -> None:
        step = self.step_of()
        if step < 0:
            return
        self.steps.add(step)
        site, mark = _call_site(frame)
        key = f"{label} at {site}"
        (self.marked if mark else self.unmarked)[key + (f" ({mark})" if mark else "")] += 1

    def uninstall(self) -> None:
        """Put the wrapped functions back."""
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals = []
        if SyncAudit._active is self:
            SyncAudit._active = None

    def report(self) -> dict[str, Any]:
        """What was counted: steps seen, unmarked and marked reads by site."""
        return {"steps": len(self.steps), "unmarked": dict(self.unmarked), "marked": dict(self.marked)}

    def write(self, path: Path) -> Path:
        """The report as JSON (atomically)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report(), indent=1, sort_keys=True))
        os.replace(tmp, path)
        return path
