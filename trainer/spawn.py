"""torchrun's worker entry when a warm standby (trainer.zygote) runs: a thin client.

Imports nothing heavy. Hands the zygote this process's environment, arguments and stdio, then
mirrors the forked worker: signals go to it, and its exit status (or the signal that killed it)
becomes ours, so torchrun sees exactly what the worker did. Without a reachable zygote it
becomes the plain worker (`python -m trainer.worker`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

from meshscope.trainer.forksafe import die_with_parent
from meshscope.trainer.zygote import HEADER, REFUSED  # light: the zygote imports torch only to warm up

ZYGOTE_ENV = "MESHSCOPE_ZYGOTE"  # the warm standby's socket
ZYGOTE_PID_ENV = "MESHSCOPE_ZYGOTE_PID"  # and its process: while it lives and warms up, we wait
WARM_UP_WAIT_S = 300.0  # a zygote that never serves (hung importing torch) is given up on


def _recv_int(conn: socket.socket) -> int | None:
    data = b""
    while len(data) < HEADER.size:
        chunk = conn.recv(HEADER.size - len(data))
        if not chunk:
            return None
        data += chunk
    return HEADER.unpack(data)[0]


def _fallback(argv: list[str], why: str) -> None:
    print(f"meshscope: warm standby unavailable ({why}); starting a plain worker", file=sys.stderr)
    entry = os.environ.get("MESHSCOPE_WORKER_ENTRY", "meshscope.trainer.worker")  # trainer.worker.ENTRY_ENV
    os.execv(sys.executable, [sys.executable, "-m", entry, *argv])


def _await_zygote(path: str) -> str | None:
    """Wait while the zygote warms up (it starts with torchrun, not before it); why not, when
    it ended or never served."""
    pid = int(os.environ.get(ZYGOTE_PID_ENV) or 0)
    deadline = time.monotonic() + WARM_UP_WAIT_S
    while pid and path and not os.path.exists(path):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "it ended without serving; see its log"
        if time.monotonic() > deadline:
            return f"not serving after {WARM_UP_WAIT_S:g} s"
        time.sleep(0.02)
    return None


def main() -> None:
    """Ask the warm standby for a worker, or start a plain one."""
    die_with_parent()  # torchrun gone, this slot goes (its forked worker follows it)
    argv = sys.argv[1:]
    path = os.environ.get(ZYGOTE_ENV, "")
    if why := _await_zygote(path):
        _fallback(argv, why)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError as err:
        _fallback(argv, f"{path or 'no socket'}: {err.strerror or err}")
    request = {"env": dict(os.environ), "argv": argv, "cwd": os.getcwd()}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    child = _recv_int(conn)
    if child is None:
        _fallback(argv, "zygote closed the connection")
    if child == REFUSED:
        _fallback(argv, "the zygote found an accelerator initialised before forking; see its log")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: os.kill(child, s))
    status = _recv_int(conn)
    if status is None:  # the zygote died: take the worker down and fail
        os.kill(child, signal.SIGKILL)
        sys.exit(1)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those cannot be caught anyway
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    sys.exit(os.WEXITSTATUS(status))


if __name__ == "__main__":
    main()
