"""Shared plumbing of the benchmarks: the repo on sys.path, gloo ranks, the machine's description."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from fixtures.dist import run_ranks  # noqa: E402,F401  (one spawner for tests and benchmarks)


def machine() -> str:
    return (
        f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )
