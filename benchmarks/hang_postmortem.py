"""The hang post-mortem on Flight Recorder dumps of multi-group jobs: does it name every faulty
rank and no healthy one?

Two sources, neither written for the reader:
  * real dumps of an 8-rank pipeline × data × tensor job on gloo (fixtures/fr_gloo, made by
    `fixtures.fr_jobs`; `--fresh` makes them again with this torch);
  * NCCL-format dumps of a 16-rank Megatron-style MoE job (`fixtures.fr_sim`: pipeline
    send/recv on their own groups and on the default group, coalesced blocks), N jobs with two
    random faults each (a compute hang before any op of the step, or one skipped op). A fault
    the job never reached (a first fault froze it earlier) is not counted as missed.

Figures: faulty ranks named / faulty ranks (recall), healthy ranks named, and the baseline
the issue measured: naming every rank of every stuck group.

    .venv/bin/python benchmarks/hang_postmortem.py [--jobs 300] [--seed 1] [--fresh]
"""

from __future__ import annotations

import argparse
import random
import tempfile
from collections import Counter
from pathlib import Path

from _common import machine

from fixtures import fr_jobs, fr_sim
from meshscope.watchdog.flight_recorder import diagnose_dumps

GLOO = fr_jobs.DUMPS


def gloo_cases(fresh: bool) -> None:
    """The real gloo dumps, case by case."""
    from fixtures.ports import free_port_range

    print("| gloo case | faults | verdict | named | right |\n|---|---|---|---|---|")
    for case, faults in fr_jobs.CASES.items():
        folder = GLOO / case
        if fresh:
            folder = fr_jobs.make_case(Path(tempfile.mkdtemp()), faults, free_port_range(1))
        diag = diagnose_dumps(folder, prefix="rank")
        right = diag.culprit_ranks == sorted(faults)
        print(
            f"| {case} | {faults or '-'} | {diag.kind.value} | {diag.culprit_ranks} | "
            f"{'yes' if right else 'NO'} |"
        )


def sweep(jobs: int, seed: int) -> None:
    """Random two-fault jobs of the 16-rank NCCL-format job."""
    rng = random.Random(seed)
    found = total = healthy = crowd = 0
    kinds: Counter[str] = Counter()
    for _ in range(jobs):
        faults = {}
        for rank in rng.sample(range(fr_sim.WORLD), 2):
            kind = rng.choice(["hang", "skip"])
            labels = [op.label for op in fr_sim.program(rank, fr_sim.FAULT_STEP)]
            faults[rank] = f"{kind}:{rng.choice(labels + (['start'] if kind == 'hang' else []))}"
        truth = fr_sim.reached(faults, fr_sim.play(faults))
        diag = diagnose_dumps(fr_sim.write_case(Path(tempfile.mkdtemp()), faults))
        named = set(diag.culprit_ranks)
        found += len(truth & named)
        total += len(truth)
        healthy += len(named - truth)
        crowd += len(
            set(r for op in diag.evidence.get("stuck_groups", []) for r in op["waiting_ranks"]) - truth
        )
        kinds[diag.kind.value] += 1
    print(f"\n{jobs} jobs × 2 faults (seed {seed}), 16 ranks:")
    print(f"- faulty ranks named: {found}/{total} = {found / max(total, 1):.1%}")
    print(f"- healthy ranks named: {healthy} (naming every stuck rank would name {crowd})")
    print(f"- verdicts: {dict(kinds)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fresh", action="store_true", help="make the gloo dumps again")
    args = parser.parse_args()
    print(f"# hang post-mortem on multi-group dumps, {machine()}")
    gloo_cases(args.fresh)
    sweep(args.jobs, args.seed)


if __name__ == "__main__":
    main()
