"""Kill -9 at random points, resume, and end bit for bit where the run that was never killed ends.

Two layouts of the tiny MoE on 2 CPU ranks, each with changes approved before the run that the
trainer applies mid-run (its control polls at steps 5, 10, 15):
- `expert-parallel`: `parallel.ep=2` with fp16 compression; a router bias (whose drift
  under the aux-loss-free update is checkpointed), an expert re-placement (experts 0 and 2
  change rank) and a capacity factor. Some tries kill inside the re-placement
  (`kill@...,during=move`: after the experts travelled, before the job agreed on them).
- `onebit-adam`: 1-bit Adam (frozen variance, compressed momentum) with a router bias and an
  auxiliary-loss coefficient.
- `onebit-buckets`: the 1-bit gradient hook (error feedback kept per parameter) over buckets of
  10 kB, so DDP's re-bucketing after each process's first iteration is in play, with a
  capacity factor.

Each try kills one worker with SIGKILL at a random step and rank; torchrun restarts the job and
it resumes from its newest checkpoint (every 5 steps). The verdict compares the try's final
checkpoint with the uninterrupted run's: every tensor of the model, the optimizer, the expert
placement, and each rank's local state (RNG, compression memories, the approved changes'
values), equal bit for bit.

usage: python benchmarks/kill_campaign.py [--tries 20] [--seed 0] [--steps 40]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from _common import machine  # first: puts the repository on sys.path

from fixtures.resume import differences, final_checkpoint, queue_changes
from fixtures.runs import start_run

LAYOUTS = {
    "expert-parallel": (
        ["--set", "parallel.ep=2", "--set", "train.compression=fp16"],
        [
            ("router_bias", 0, [0.01, 0.0, 0.0, 0.0, 0.0]),
            ("expert_placement", 1, [2, 1, 0, 3]),
            ("capacity_factor", -1, [2.0]),
        ],
    ),
    "onebit-adam": (
        ["--set", "train.compression=onebit_adam", "--set", "train.compression_warmup=4"],
        [("router_bias", -1, [0.01, 0.0, 0.0, 0.0, 0.0]), ("aux_loss_coef", -1, [0.05])],
    ),
    "onebit-buckets": (
        ["--set", "train.compression=onebit", "--set", "train.bucket_cap_mb=0.01"],
        [("capacity_factor", -1, [2.0])],
    ),
}
MOVE_STEP = 10  # the poll that applies the second approved change (the re-placement)


def _run(root: Path, run_id: str, layout: str, steps: int, *extra: str) -> Path:
    flags, changes = LAYOUTS[layout]
    queue_changes(root / run_id, changes)
    common = [
        "--steps",
        str(steps),
        "--checkpoint-every",
        "5",
        "--max-restarts",
        "2",
        "--set",
        "control_every=5",
    ]
    proc = start_run(root, run_id, None, *common, *flags, *extra, new_session=True)
    out, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{run_id}: exit {proc.returncode}\n{out[-3000:]}")
    return root / run_id


def _events(run_dir: Path) -> dict[str, int]:
    from meshscope.collector.store import load_events

    kinds = load_events(run_dir)["kind"].value_counts()
    return {k: int(kinds.get(k, 0)) for k in ("injected", "restart", "resume", "suggestion_applied")}


def main() -> int:
    """Run the campaign; exit 1 unless every try ends bit-identical."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="kill-campaign-"))
    clean = {name: final_checkpoint(_run(root, f"clean-{name}", name, args.steps)) for name in LAYOUTS}
    identical = 0
    for i in range(args.tries):
        layout = list(LAYOUTS)[i % len(LAYOUTS)]
        during = "move" if layout == "expert-parallel" and rng.random() < 0.5 else "step"
        step = rng.randint(1, MOVE_STEP - 1) if during == "move" else rng.randint(1, args.steps - 2)
        spec = f"kill@step={step},rank={rng.randint(0, 1)},during={during}"
        started = time.perf_counter()
        run_dir = _run(root, f"try{i:02d}", layout, args.steps, "--inject", spec)
        diff = differences(clean[layout], final_checkpoint(run_dir))
        identical += not diff
        verdict = "identical" if not diff else f"DIFFERS at {diff[:3]}"
        took = time.perf_counter() - started
        print(f"{i:2d} {layout:16s} {spec:34s} {_events(run_dir)} {took:5.1f} s  {verdict}")
        sys.stdout.flush()
    print(f"bit-identical resumes: {identical}/{args.tries}  (runs under {root}; {machine()})")
    return 0 if identical == args.tries else 1


if __name__ == "__main__":
    sys.exit(main())
