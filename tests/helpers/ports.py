"""Free ports on 127.0.0.1 for tests that start servers."""

from __future__ import annotations

import random
import socket


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port_range(count: int = 1, low: int = 20000, high: int = 60000) -> int:
    """First port of `count` consecutive free ports."""
    for _ in range(200):
        base = random.randint(low, high - count)
        if all(_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no free port range found")
