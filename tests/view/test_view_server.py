"""`meshscope view` as a process: a SIGTERM to it (what a service manager sends) frees its port."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import requests

from fixtures.ports import free_port_range
from fixtures.runs import REPO


def test_sigterm_to_meshscope_view_stops_streamlit_and_frees_the_port(tmp_path):
    port = free_port_range(1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshscope", "view", "--runs", str(tmp_path), "--port", str(port)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/_stcore/health", timeout=2).ok:
                break
        except requests.RequestException:
            time.sleep(0.3)
    else:
        proc.kill()
        raise AssertionError("meshscope view did not come up")
    proc.send_signal(signal.SIGTERM)  # to that process only, not its group
    proc.wait(timeout=30)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))  # free: nothing is left serving it
