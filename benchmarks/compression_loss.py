"""Loss after a longer run with each gradient compression, against none: the demo config on
2 CPU ranks, 300 steps, mean loss of steps 290-299 over both ranks; and the bytes each put on
the wire, over the whole run and per step after its warm-up, against none's.

    .venv/bin/python benchmarks/compression_loss.py [--steps 300]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, machine

from meshscope.collector.store import load_steps
from meshscope.config import load_config

CASES = [
    ("none", 0),
    ("fp16", 0),
    ("powersgd", 0),
    ("onebit", 0),
    ("onebit", 30),
    ("onebit", 100),
    ("onebit_adam", 30),
    ("onebit_adam", 60),
]


def run(root: Path, compression: str, warmup: int, steps: int, port: int) -> tuple[float, float, float]:
    """Train one case; the mean loss of its last 10 steps, its wire bytes over the run and per
    step after its warm-up."""
    name = f"{compression}-w{warmup}"
    cfg = load_config(
        REPO / "configs" / "demo.toml",
        {
            "run_id": name,
            "runs_root": str(root),
            "nproc": 2,
            "metrics_port": port,
            "train": {"steps": steps, "compression": compression, "compression_warmup": warmup},
        },
    )
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    config = cfg.run_dir / "config.json"
    config.write_text(cfg.model_dump_json())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME="lo")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "meshscope.trainer.worker",
            "--config",
            str(config),
        ],
        env=env,
        check=True,
        capture_output=True,
        cwd=REPO,
    )
    df = load_steps(cfg.run_dir)
    after = df[df["step"] >= warmup]
    return (
        float(df[df["step"] >= steps - 10]["loss"].mean()),
        float(df["bytes_wire"].sum()),
        float(after["bytes_wire"].mean()),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--only", nargs="*", default=None, metavar="NAME", help="these compressions (and none)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="meshscope-loss-"))
    losses = {}
    for i, (compression, warmup) in enumerate(CASES):
        if args.only and compression not in {"none", *args.only}:
            continue
        losses[(compression, warmup)] = run(root, compression, warmup, args.steps, 9800 + 10 * i)
    base, base_total, base_step = losses[("none", 0)]
    print(
        f"| compression | warm-up steps | loss, steps {args.steps - 10}-{args.steps - 1} | vs none "
        "| wire bytes, whole run / none | per step after warm-up / none |"
    )
    print("|---|---|---|---|---|---|")
    for (compression, warmup), (loss, total, per_step) in losses.items():
        print(
            f"| {compression} | {warmup} | {loss:.3f} | {100 * (loss / base - 1):+.1f} % "
            f"| 1/{base_total / total:.1f} | 1/{base_step / per_step:.1f} |"
        )
    print(machine())


if __name__ == "__main__":
    main()
