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


def run_on_two_nodes(root: Path, name: str, link: str, steps: int, *settings: str) -> list[Path]:
    """`meshscope run` of one rank on each of two emulated nodes (network namespaces, the link
    rate-limited to `link`), `configs/demo.toml` with `settings` (`--set` pairs); each node's
    run directory. Reused when node 0's store is already there (`--keep`)."""
    import subprocess

    from fixtures.netns import nodes
    from fixtures.ports import free_port_range

    dirs = [root / f"{name}-node{i}" / name for i in range(2)]
    if (dirs[0] / "store.sqlite").exists():
        return dirs
    port = free_port_range(1)
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}  # the route's, as a user has it
    with nodes(2) as pair:
        for node in pair:
            node.limit(link)
        procs = []
        for run_dir, node in zip(dirs, pair):
            cmd = [sys.executable, "-m", "meshscope", "run", "--config", str(REPO / "configs/demo.toml")]
            cmd += ["--run-dir", str(run_dir.parent), "--run-id", name, "--nproc", "1", "--steps", str(steps)]
            cmd += [
                "--nnodes",
                "2",
                "--rdzv-endpoint",
                f"{pair[0].address}:{port}",
                "--metrics-port",
                "19890",
            ]
            for setting in settings:
                cmd += ["--set", setting]
            procs.append(subprocess.Popen(node.command(*cmd), cwd=REPO, env=env, stdout=subprocess.DEVNULL))
        for proc in procs:
            assert proc.wait(timeout=600) == 0, name
    return dirs


def warm_trainer(cfg, device, warmup: int = 3):
    """A Monitor (no exporter), the reference trainer's state on `device` at world 1, and a
    no-op injector, after `warmup` watched steps (allocator, kernels): (mon, state, injector)."""
    from prometheus_client import CollectorRegistry

    from meshscope.collector import Monitor, MonitorConfig
    from meshscope.trainer.inject import Injector
    from meshscope.trainer.loop import build, train_step

    mon = Monitor(
        MonitorConfig(run_dir=cfg.run_dir, metrics_port=None),
        probe=device.probe(),
        registry=CollectorRegistry(),
    )
    state = build(cfg, device, mon, rank=0, world_size=1)
    injector = Injector([], 0, lambda inj, step: None)
    for _ in range(warmup):
        train_step(state, mon, cfg, device, injector)
    return mon, state, injector
