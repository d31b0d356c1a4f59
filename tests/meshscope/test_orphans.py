"""Killing `meshscope run`, SIGKILL included, takes every process it started with it: torchrun,
the warm standby and the workers (the kernel's parent-death signal; nothing under PID 1)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from fixtures.runs import start_run


def _started_by(run: Path, cli_pid: int) -> list[tuple[int, str]]:
    """Live processes of this run: torchrun and its workers name the run folder, the warm
    standby and what it forked name the CLI's standby socket."""
    marks = (str(run), f"meshscope-zygote-{cli_pid}")
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(
                line for line in (entry / "status").read_text().splitlines() if line.startswith("State")
            )
        except (OSError, StopIteration):
            continue
        if "Z" not in state and any(mark in cmdline for mark in marks):
            found.append((int(entry.name), cmdline[:160]))
    return found


def test_killing_the_cli_leaves_no_process_behind(tmp_path):
    proc = start_run(tmp_path, "o", None, "--nproc", "2", "--steps", "100000")
    run = tmp_path / "o"
    deadline = time.monotonic() + 150
    while not list((run / "live").glob("rank*.flight")) if (run / "live").is_dir() else True:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.5)
    assert len(_started_by(run, proc.pid)) >= 3  # torchrun and two workers, at least
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while (left := _started_by(run, proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid, _ in left:  # never leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running 10 s after the CLI died: {left}"
