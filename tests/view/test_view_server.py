"""`meshscope view` as a process: a SIGTERM to it (what a service manager sends) frees its port."""

from __future__ import annotations

import signal
import socket
from urllib.parse import urlparse

from fixtures.runs import start_view


def test_sigterm_to_meshscope_view_stops_streamlit_and_frees_the_port(tmp_path):
    proc, url = start_view(tmp_path)
    proc.send_signal(signal.SIGTERM)  # to that process only, not its group
    proc.wait(timeout=30)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", urlparse(url).port))  # free: nothing is left serving it
