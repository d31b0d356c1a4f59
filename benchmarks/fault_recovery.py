"""Recovery from kill -9: time from the kill to the first completed step after resume.

One job per variant runs under torchrun with checkpoints every few steps; the benchmark kills
rank 1's worker with SIGKILL at steps S, 2S, ... and reads the resumed attempt's `resume` event,
which records when the failure was detected (survivors' exit marks), when the new worker
process started, when its process group was ready and when the checkpoint was restored; the
first step record after resume closes the interval. Median of the kills, steps lost.

Variants (same invocation): `plain` = torchrun defaults, workers start from a fresh interpreter;
`warm` = meshscope's warm standby: torchrun's worker entry asks a pre-imported zygote to fork
the worker (trainer/zygote.py).

    .venv/bin/python benchmarks/fault_recovery.py [--kills 5 --every 25 --device cpu]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, machine

from meshscope.collector.store import latest_step, load_events, load_steps


def worker_pid(run_dir: Path, rank: int) -> int | None:
    """The live worker process of this run with this rank (from `<run>/pids/`)."""
    try:
        pid = int((run_dir / "pids" / f"rank{rank}.pid").read_text())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def run_variant(name: str, root: Path, args: argparse.Namespace) -> list[dict]:
    steps = args.every * (args.kills + 1) + 10
    config = root / f"{name}.toml"
    text = (REPO / "fixtures/tiny.toml").read_text()
    config.write_text(text + f"\n[elastic]\nwarm_standby = {str(name == 'warm').lower()}\n")
    cmd = [
        sys.executable,
        "-m",
        "meshscope",
        "run",
        "--config",
        str(config),
        "--run-dir",
        str(root),
        "--run-id",
        name,
        "--steps",
        str(steps),
        "--checkpoint-every",
        str(args.checkpoint_every),
        "--max-restarts",
        str(args.kills + 1),
        "--metrics-port",
        str(args.port),
        "--device",
        args.device,
        "--backend",
        args.backend,
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_dir = root / name
    kills = []
    for k in range(1, args.kills + 1):
        target = k * args.every + 2  # two steps past a checkpoint: two steps are lost
        while latest_step(run_dir, rank=1) < target and proc.poll() is None:
            time.sleep(0.01)
        pid = worker_pid(run_dir, 1)
        if pid is None:
            break
        os.kill(pid, signal.SIGKILL)
        kills.append({"at": time.time(), "step": latest_step(run_dir, rank=1)})
        while latest_step(run_dir, rank=1) < target + 1 and proc.poll() is None:
            time.sleep(0.01)  # wait for the resumed attempt to pass the kill point
    proc.wait(timeout=600)
    return split(run_dir, kills)


def split(run_dir: Path, kills: list[dict]) -> list[dict]:
    resumes = load_events(run_dir, kind="resume")
    steps = load_steps(run_dir)
    out = []
    for kill, (_, ev) in zip(kills, resumes.iterrows()):
        d = ev["detail"]
        first = steps[(steps["step"] == d["from_step"]) & (steps["time"] > kill["at"])]
        first_done = float((first["time"] + first["step_s"]).max())
        out.append(
            {
                "total": first_done - kill["at"],
                "detection": d["detected_at"] - kill["at"],
                "restart+rendezvous": d["group_ready_at"] - d["detected_at"],
                "of which imports": d["group_ready_at"] - d["process_started_at"],
                "restore": d["restored_at"] - d["group_ready_at"],
                "first step": first_done - d["restored_at"],
                "steps_lost": d["steps_lost"],
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--every", type=int, default=25, help="steps between kills")
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--port", type=int, default=9800)
    ap.add_argument("--device", default="cpu", help="cpu | cuda | npu")
    ap.add_argument("--backend", default="auto", help="auto | gloo (two ranks on one accelerator need gloo)")
    args = ap.parse_args()
    print(f"machine: {machine()}")
    print(
        f"2 ranks on {args.device} ({args.backend}), tiny MoE, "
        f"checkpoint every {args.checkpoint_every} steps, "
        f"{args.kills} kills of rank 1 each"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("plain", "warm"):
            rows = run_variant(variant, Path(tmp), args)
            if not rows:
                print(f"{variant}: no recoveries measured")
                continue
            keys = [k for k in rows[0] if k != "steps_lost"]
            med = {k: statistics.median(r[k] for r in rows) for k in keys}
            print(
                f"{variant:6} n={len(rows)} median "
                + "  ".join(f"{k} {v:.2f}s" for k, v in med.items())
                + f"  steps lost {statistics.median(r['steps_lost'] for r in rows):.0f}"
            )
            print("        totals: " + ", ".join(f"{r['total']:.2f}" for r in rows))


if __name__ == "__main__":
    main()
