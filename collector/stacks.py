"""The stack protocol between a rank and the hang watchdog, both sides in one place.

The watchdog asks by writing a request id to `<live>/request`; each rank's responder thread sees
the file change and writes every thread's Python stack to `<flight log>.stacks.json`, tagged with
that id; faulthandler writes a crashing rank's stacks to `<flight log>.crash`. Files, not the
process group: the group may be the thing that is stuck.

Where the collective backend keeps its own Flight Recorder (a trace buffer set through
`TORCH_FR_BUFFER_SIZE`, NCCL's `TORCH_NCCL_TRACE_BUFFER_SIZE` or torch_npu's
`TORCH_HCCL_TRACE_BUFFER_SIZE`), the responder also dumps it on the same request, to
`<flight log>.fr` (no abort, no timeout needed): the backend's own device states (scheduled,
started, completed) for the watchdog. The dump functions are feature-detected by name:
torch_npu's `_dump_hccl_trace`, c10d's `_dump_nccl_trace` (older builds) and `_dump_fr_trace`."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from meshscope.collector.service import Service

REQUEST_FILE = "request"
STACKS_SUFFIX = ".stacks.json"
CRASH_SUFFIX = ".crash"
RESPONDER_THREAD = "meshscope-flight"  # its own stack is never part of an answer


LIBRARY = "[lib] "  # marks a frame of an installed library or the standard library
_LIBRARY_ROOTS = sorted(
    {os.path.join(sysconfig.get_paths()[k], "") for k in ("purelib", "platlib", "stdlib", "platstdlib")},
    key=len,
    reverse=True,
)
_MESHSCOPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")  # rooms' home
_ROOTS = sorted([*_LIBRARY_ROOTS, _MESHSCOPE], key=len, reverse=True)
# frames of stores written before the marker: torch's folders as two-part paths show them
_TORCH_PARTS = {
    "torch",
    "autograd",
    "distributed",
    "nn",
    "modules",
    "optim",
    "parallel",
    "futures",
    "_tensor.py",
}


def frame_text(filename: str, line: Any, name: str = "") -> str:
    """One frame as stacks show it: a library's as `[lib] package/path.py:N name`, the user's and
    meshscope's own as the last two parts of its path."""
    # the longest root that holds it: meshscope's own folder (in site-packages or a checkout
    # whose venv sits inside it) wins over a library root that merely contains it
    root = next((r for r in _ROOTS if filename.startswith(r)), None)
    if root == _MESHSCOPE:
        root = None
    if root is not None:
        return f"{LIBRARY}{filename[len(root) :]}:{line} {name}".rstrip()
    return f"{'/'.join(filename.rsplit('/', 2)[-2:])}:{line} {name}".rstrip()


# meshscope's own watching code as stacks name it: a frame here says only that it watched
_COLLECTOR = tuple(
    f"collector/{name}:"
    for name in sorted(os.listdir(os.path.dirname(os.path.abspath(__file__))))
    if name.endswith(".py")
)


def own_frame(stack: list[str]) -> str:
    """The innermost frame of the code a rank runs (the user's, or meshscope's trainer): where
    it was. Library frames say only how the call went down, and the collector's (the flight
    log's wrappers, the control plane, the Monitor) only that meshscope watched it; a stack of
    nothing else names the collector's innermost frame."""
    ours = [
        line for line in stack if not line.startswith(LIBRARY) and line.split("/", 1)[0] not in _TORCH_PARTS
    ]
    theirs = [line for line in ours if not line.startswith(_COLLECTOR)]
    return (theirs or ours or stack or [""])[-1]


def _frame_text(frame: traceback.FrameSummary) -> str:
    return frame_text(frame.filename, frame.lineno, frame.name)


def write_stacks(flight: Path, request_id: str = "", step: int = -1) -> Path:
    """Every thread's Python stack, the main thread first, next to the flight log `flight`."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    stacks = {}
    for ident, frame in sorted(sys._current_frames().items(), key=lambda kv: kv[0] != main):
        if names.get(ident, "").startswith(RESPONDER_THREAD):
            continue
        lines = [_frame_text(f) for f in traceback.extract_stack(frame)]
        stacks[names.get(ident, str(ident))] = lines[-24:]
    out = Path(flight).with_suffix(STACKS_SUFFIX)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"request": request_id, "time": time.time(), "step": step, "stacks": stacks}))
    os.replace(tmp, out)
    return out


FR_SUFFIX = ".fr"
FR_BUFFER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_HCCL_TRACE_BUFFER_SIZE")


def recorder_dump() -> Callable[[], bytes] | None:
    """The backend's Flight Recorder dump function, when a trace buffer is on and one exists."""
    if not any(os.environ.get(name, "0").strip() not in ("", "0") for name in FR_BUFFER_ENV):
        return None
    torch_npu = sys.modules.get("torch_npu")  # never imported here: only if the job did
    c10d_npu = getattr(getattr(torch_npu, "_C", None), "_distributed_c10d", None)
    import torch

    c10d = torch._C._distributed_c10d
    for owner, name in ((c10d_npu, "_dump_hccl_trace"), (c10d, "_dump_nccl_trace"), (c10d, "_dump_fr_trace")):
        dump = getattr(owner, name, None)
        if callable(dump):
            return lambda dump=dump: dump(includeCollectives=True, includeStackTraces=False, onlyActive=False)
    return None


def write_recorder_dump(flight: Path, request_id: str, dump: Callable[[], bytes]) -> Path | None:
    """The backend's Flight Recorder, dumped beside the flight log for `request_id`."""
    try:
        raw = dump()
    except Exception:  # noqa: BLE001  (a backend without a recorder for this group: no dump)
        return None
    out = Path(flight).with_suffix(FR_SUFFIX)
    tmp = out.with_suffix(".fr.tmp")
    tmp.write_bytes(raw)
    os.replace(tmp, out)
    tag, tag_tmp = out.with_suffix(".fr.request"), out.with_suffix(".fr.request.tmp")
    tag_tmp.write_text(request_id)  # after the dump: a tag always names a whole dump
    os.replace(tag_tmp, tag)
    return out


def recorder_answer(flight: Path, request_id: str) -> Path | None:
    """The Flight Recorder dump a rank wrote for `request_id`, if it wrote one."""
    out = Path(flight).with_suffix(FR_SUFFIX)
    try:
        if out.with_suffix(".fr.request").read_text().strip() == request_id:
            return out
    except OSError:
        return None
    return None


class StackResponder(Service):
    """The flight log's responder: `answer(request_id)` each time the request file changes.
    On Linux it sleeps in the kernel until the file is replaced (inotify): a rank that is never
    asked spends nothing on it. Where there are no notifications (another OS) it looks every
    `poll_s`, and with them it still looks every `RECHECK_S`, for a filesystem that misses some
    (a network mount written from another host). Stopped without a wait: it ends when it wakes."""

    def __init__(self, folder: Path, answer: Callable[[str], object], poll_s: float = 0.2) -> None:
        super().__init__(RESPONDER_THREAD, poll_s, join_s=RECHECK_S + 1.0)
        self.folder, self.answer = Path(folder), answer
        self._answered: int | None = None
        self._watch: contextlib.ExitStack | None = None
        self._wait: Callable[[float], None] = time.sleep

    def before_rounds(self) -> None:
        """Watch the folder, then look once: a request already there is answered now."""
        self._watch = contextlib.ExitStack()
        self._wait = self._watch.enter_context(_request_watch(self.folder))
        self.round()

    def idle(self) -> None:
        """Asleep until the request file changes (or the fallback interval)."""
        self._wait(self.interval_s)

    def round(self) -> None:
        """Answer the request file if it changed since the last answer."""
        request = self.folder / REQUEST_FILE
        try:
            stamp = request.stat().st_mtime_ns
        except FileNotFoundError:
            return
        if stamp != self._answered:
            self._answered = stamp
            self.answer(request.read_text().strip())

    def after_rounds(self) -> None:
        """Stop watching the folder."""
        if self._watch is not None:
            self._watch.close()


RECHECK_S = 2.0  # with notifications: the safety look at the request file


@contextlib.contextmanager
def _request_watch(folder: Path) -> Iterator[Callable[[float], None]]:
    """A wait that returns when the request file is replaced in `folder` (or after the
    fallback interval): inotify where there is one, a sleep where there is not."""
    try:
        from inotify_simple import INotify, flags

        notify = INotify()
    except (ImportError, OSError):  # not Linux, or the user's inotify instances used up: poll
        yield time.sleep
        return
    with notify:
        try:
            notify.add_watch(folder, flags.MOVED_TO | flags.CLOSE_WRITE)
        except OSError:  # the user's inotify watches used up: poll
            yield time.sleep
            return

        def wait(poll_s: float) -> None:
            notify.read(timeout=int(RECHECK_S * 1000))  # a change in the folder, or the safety look

        yield wait


def request_stacks(live_dir: Path, request_id: str) -> None:
    """Ask every rank of `live_dir` for its stacks (atomically: a rank never reads half an id)."""
    tmp = Path(live_dir) / f"{REQUEST_FILE}.tmp"
    tmp.write_text(request_id)
    os.replace(tmp, Path(live_dir) / REQUEST_FILE)


def stack_answer(flight: Path, request_id: str | None) -> list[str] | None:
    """The main thread's stack a rank wrote for `request_id` (None: whatever it wrote last)."""
    try:
        data = json.loads(Path(flight).with_suffix(STACKS_SUFFIX).read_text())
    except (OSError, ValueError):
        return None
    if request_id is not None and data.get("request") != request_id:
        return None
    return next(iter(data.get("stacks", {}).values()), None)


def crash_path(flight: Path) -> Path:
    """Where faulthandler writes a rank's crash stacks."""
    return Path(flight).with_suffix(CRASH_SUFFIX)


def crash_stack(flight: Path) -> list[str]:
    """The crashing thread's frames from a faulthandler dump (a rank that aborted), outermost
    first like the responder's stacks."""
    try:
        text = crash_path(flight).read_text(errors="replace")
    except OSError:
        return []
    sections = text.split("\n\n")
    current = next((s for s in sections if "Current thread" in s), sections[0])
    frames = []
    for line in current.splitlines():
        line = line.strip()
        if line.startswith('File "') and "line " in line:
            frames.append(frame_text(line.split('"')[1], line.split("line ", 1)[1]))
    return frames[::-1]
