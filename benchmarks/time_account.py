"""Where the time went, on real runs: the time account (`collector/timeaccount.py`) of the demo,
a run with a kill, a run with a hang the watchdog aborts, and a job on two agents.

Each scenario is a `meshscope run` as a user types it; the account is read from the store it
left (the two agents' node stores together for the two-agent job: what a job store holds).
Printed per scenario: the wall time, ETTR, every bucket's share, and the largest gap between a
rank's buckets and the wall time (0 by construction: the check that nothing was counted twice
or lost).

    .venv/bin/python benchmarks/time_account.py [--only demo kill hang nodes]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
from _common import REPO, machine

from meshscope.collector.store import load_events, load_retried_steps, load_steps
from meshscope.collector.timeaccount import BUCKETS, TimeAccount, time_account

TINY = REPO / "fixtures" / "tiny.toml"
SCENARIOS = {
    "demo": ("--config", "configs/demo.toml"),
    "kill": ("--config", str(TINY), "--steps", "60", "--checkpoint-every", "10", "--max-restarts", "1",
             "--inject", "kill@step=35,rank=1"),
    "hang": ("--config", str(TINY), "--steps", "40", "--checkpoint-every", "10", "--max-restarts", "1",
             "--inject", "hang@step=25,rank=1,seconds=600", "--on-hang", "abort"),
}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def meshscope_run(root: Path, run_id: str, *flags: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "meshscope", "run", "--run-dir", str(root), "--run-id", run_id]
    cmd += ["--metrics-port", str(port), *flags]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def account_of(*run_dirs: Path) -> TimeAccount:
    """One job's account from the stores of its nodes."""
    steps = pd.concat([load_steps(d) for d in run_dirs], ignore_index=True)
    retried = pd.concat([load_retried_steps(d) for d in run_dirs], ignore_index=True)
    events = pd.concat([load_events(d) for d in run_dirs], ignore_index=True)
    return time_account(steps, retried, events)


def run_one(root: Path, name: str, flags: tuple[str, ...]) -> TimeAccount:
    proc = meshscope_run(root, name, *flags, port=free_port())
    out, _ = proc.communicate(timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: meshscope run failed\n{out[-3000:]}")
    return account_of(root / name)


def run_nodes(root: Path) -> TimeAccount:
    """Two agents on this machine, two ranks each, one rendezvous: a job on two 'nodes'."""
    rdzv = free_port()
    flags = ("--config", str(TINY), "--steps", "60", "--nproc", "2", "--nnodes", "2")
    procs = [
        meshscope_run(
            root / f"node{i}",
            "job",
            *flags,
            "--rdzv-endpoint",
            f"127.0.0.1:{rdzv}",
            port=free_port() + 10 * i,
        )
        for i in range(2)
    ]
    for i, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"node{i}: meshscope run failed\n{out[-3000:]}")
    return account_of(root / "node0" / "job", root / "node1" / "job")


def report(name: str, command: str, account: TimeAccount) -> None:
    off = max(abs(sum(b.values()) - account.wall_s) for b in account.ranks.values())
    shares = account.shares()
    print(f"{name}: `{command}`")
    print(f"    wall {account.wall_s:.1f} s, ETTR {account.ettr:.1%}, ranks {len(account.ranks)}, "
          f"largest |sum of buckets - wall| over ranks {off:.2e} s")  # fmt: skip
    print("    " + ", ".join(f"{b} {shares[b]:.1%}" for b in BUCKETS))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="+", choices=[*SCENARIOS, "nodes"], default=[*SCENARIOS, "nodes"])
    args = ap.parse_args()
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        for name in args.only:
            if name == "nodes":
                report(
                    name,
                    "two agents: meshscope run --nproc 2 --nnodes 2 --rdzv-endpoint ...",
                    run_nodes(root),
                )
            else:
                flags = SCENARIOS[name]
                report(name, "meshscope run " + " ".join(flags), run_one(root, name, flags))


if __name__ == "__main__":
    main()
