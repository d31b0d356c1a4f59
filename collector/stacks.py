"""The stack protocol between a rank and the hang watchdog, both sides in one place.

The watchdog asks by writing a request id to `<live>/request`; each rank's responder thread sees
the file change and writes every thread's Python stack to `<flight log>.stacks.json`, tagged with
that id; faulthandler writes a crashing rank's stacks to `<flight log>.crash`. Files, not the
process group: the group may be the thing that is stuck."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REQUEST_FILE = "request"
STACKS_SUFFIX = ".stacks.json"
CRASH_SUFFIX = ".crash"
RESPONDER_THREAD = "meshscope-flight"  # its own stack is never part of an answer


def _frame_text(frame: traceback.FrameSummary) -> str:
    return f"{'/'.join(frame.filename.rsplit('/', 2)[-2:])}:{frame.lineno} {frame.name}"


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


def answer_requests(
    folder: Path, answer: Callable[[str], object], stop: threading.Event, poll_s: float = 0.2
) -> None:
    """The responder's loop: call `answer(request_id)` each time the request file changes."""
    request, answered = Path(folder) / REQUEST_FILE, None
    while not stop.wait(poll_s):
        try:
            stamp = request.stat().st_mtime_ns
        except FileNotFoundError:
            continue
        if stamp != answered:
            answered = stamp
            answer(request.read_text().strip())


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
            where = "/".join(line.split('"')[1].rsplit("/", 2)[-2:])
            frames.append(f"{where}:{line.split('line ', 1)[1]}")
    return frames[::-1]
