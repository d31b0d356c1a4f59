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


def timed_blocks(variants, built, step, blocks: int, block_steps: int, times: dict) -> dict:
    """Step every variant in blocks of `block_steps`, the order rotating block by block (so no
    variant always follows the same one), and append each step's wall time to `times`."""
    import time

    for b in range(blocks):
        for v in variants[b % len(variants) :] + variants[: b % len(variants)]:
            for i in range(block_steps):
                t0 = time.perf_counter()
                step(v, *built[v], i)
                times.setdefault(v, []).append(time.perf_counter() - t0)
    return times
