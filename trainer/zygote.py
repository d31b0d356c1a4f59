"""Warm standby: a fork server that has already imported torch and warmed the optimizer.

A restarted worker pays ~3 s to import torch and ~1 s for the first optimizer step (lazy imports
of torch._dynamo) before it can resume. The zygote pays that once per node, before the job
starts; torchrun's worker entry (`trainer.spawn`) is a thin client that hands the zygote its
environment, arguments and stdio, and the zygote forks a ready worker in milliseconds. The
zygote never touches an accelerator, so forking stays safe for CUDA/NPU: devices are
initialised in the child.

The client and its worker live and die together: the zygote reports the worker's exit status
to the client, and kills the worker if the client goes away (torchrun killed it).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import select
import signal
import socket
import struct
import sys
import time
import traceback
from pathlib import Path

from meshscope.trainer.forksafe import (
    NVML_CHECK_ENV,
    AcceleratorTripwire,
    die_with_parent,
    fork_hazard,
    probe_fork,
)

HEADER = struct.Struct("!I")
REFUSED = 0  # sent instead of a pid: forking is unsafe, start a plain worker
UNSAFE_EXIT = 3  # the zygote's exit code when its warm-up left it unable to fork safely


def warm_up() -> None:
    """Import what a worker imports and take one optimizer step, so the children don't."""
    import torch

    import meshscope.trainer.worker  # (torch.distributed, DCP, pandas, prometheus_client...)

    importlib.import_module(os.environ.get(meshscope.trainer.worker.ENTRY_ENV, "meshscope.trainer.worker"))

    layer = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3, fused=True)  # as the trainer builds it
    # Gradients set by hand, never by a backward: the autograd engine's first backward counts
    # every device type's devices in C++, which initialises the CUDA driver (forks then fail).
    for p in layer.parameters():
        p.grad = torch.ones_like(p)
    opt.step()


def _run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the worker torchrun asked for, then exit."""
    die_with_parent()  # the standby is the parent: a worker never outlives it
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = ["meshscope.trainer.worker", *request["argv"]]
    code = 0
    try:
        import meshscope.trainer.worker

        meshscope.trainer.worker.STARTED_AT = time.time()  # this worker's life starts at the fork
        entry = importlib.import_module(
            os.environ.get(meshscope.trainer.worker.ENTRY_ENV, "meshscope.trainer.worker")
        )
        entry.main(request["argv"])
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def serve(path: Path, tripwire: AcceleratorTripwire) -> int:
    """Single-threaded accept/reap loop: no thread is ever alive when we fork.

    Returns UNSAFE_EXIT, without ever serving, when the warm-up made forking unsafe."""
    warm_up()
    hazard = fork_hazard(tripwire) or probe_fork(tripwire)
    if hazard:
        print(f"meshscope zygote: not serving, forking is unsafe: {hazard}", file=sys.stderr)
        return UNSAFE_EXIT
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    staging = path.with_name(path.name + ".tmp")  # clients wait for `path`: it appears listening
    staging.unlink(missing_ok=True)
    server.bind(str(staging))
    server.listen(64)
    os.replace(staging, path)
    clients: dict[int, socket.socket] = {}  # child pid -> client connection
    by_conn: dict[socket.socket, int] = {}
    signal.signal(signal.SIGTERM, _leave)
    while True:
        readable, _, _ = select.select([server, *by_conn], [], [], 0.05)
        for sock in readable:
            if sock is server:
                conn, _ = server.accept()
                msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                request = json.loads(msg)
                hazard = fork_hazard(tripwire)
                if hazard:  # this client starts a plain worker; running workers carry on
                    print(f"meshscope zygote: refusing to fork: {hazard}", file=sys.stderr)
                    conn.sendall(HEADER.pack(REFUSED))
                    conn.close()
                    for fd in fds:
                        os.close(fd)
                    continue
                pid = os.fork()
                if pid == 0:
                    server.close()
                    tripwire.uninstall()  # the worker is meant to use its device
                    _run_child(request, fds)
                for fd in fds:
                    os.close(fd)
                conn.sendall(HEADER.pack(pid))
                clients[pid], by_conn[conn] = conn, pid
            elif not sock.recv(1):  # the client died: its worker goes with it
                pid = by_conn.pop(sock)
                _kill(pid)
                sock.close()
        _reap(clients, by_conn)


def _leave(*_: object) -> None:
    """Go at once: the zygote holds nothing to save, and unwinding torch at exit costs seconds
    on every run's way out."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(clients: dict[int, socket.socket], by_conn: dict[socket.socket, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = clients.pop(pid, None)
        if conn is not None:
            by_conn.pop(conn, None)
            try:
                conn.sendall(HEADER.pack(status & 0xFFFF))
            except OSError:
                pass
            conn.close()


def main() -> None:
    """Serve fork requests until the agent goes."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--socket", type=Path, required=True)
    ap.add_argument(
        "--strict", action="store_true", help="raise where the warm-up touches an accelerator (tests)"
    )
    args = ap.parse_args()
    # Before torch is imported: availability checks through NVML do not poison later forks.
    os.environ.setdefault(NVML_CHECK_ENV, "1")
    tripwire = AcceleratorTripwire(strict=args.strict).install()
    sys.exit(serve(args.socket, tripwire))


if __name__ == "__main__":
    main()
