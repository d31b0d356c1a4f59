"""Which host reads of tensor values happen during training steps, by call site.

meshscope promises never to stall the device: nothing it adds to a step makes the host wait
for a device value, except where it says so (`# sync point` on the line). `SyncAudit` checks
the promise the way `torch.cuda.set_sync_debug_mode` would, on any device, the simulated one
included: it wraps the tensor methods that read a value on the host (`item`, `tolist`,
`__bool__`, `__float__`, `__int__`, `__index__`, `numpy`, `cpu`) and the device modules'
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


class SyncAudit:
    """Counts host reads of tensor values in training steps (see the module doc)."""

    _active: SyncAudit | None = None

    def __init__(self, step_of: Any = None) -> None:
        self.step_of = step_of or (lambda: 0)  # the running step (< 0: not in a step)
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
        for module in modules:
            if module is not None and hasattr(module, "synchronize"):
                self._wrap(module, "synchronize", "synchronize")
                event = getattr(module, "Event", None)
                if event is not None and hasattr(event, "synchronize"):
                    self._wrap(event, "synchronize", "Event.synchronize")
        return self

    def _wrap(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)
        audit = self

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not audit._inside:  # a read inside a counted read is the same read
                audit._count(label, sys._getframe(1))
            audit._inside = True
            try:
                return original(*args, **kwargs)
            finally:
                audit._inside = False

        self._originals.append((owner, name, original))
        setattr(owner, name, counted)

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
