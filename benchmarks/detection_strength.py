"""Recall against fault strength, on runs recorded now, after the thresholds were fixed.

`detection_quality.py` scores one injection per kind, so its recall is 0 or 1, and accepts any
of several anomaly types as a hit. Here every kind is injected at several strengths, three times
per run at steps 60, 120 and 180 (10 steps each, ranks alternating), in `--runs` fresh runs of
2 CPU ranks (recorded at benchmark time into a temporary folder: nothing here was tuned on
them). A hit is an episode of the kind's own type only (a slow rank: `straggler` naming that
rank; a comm delay: `comm`; a leak: `memory` naming the rank) overlapping the fault or the 5
steps after it. Delay is counted from the injection to the step that announced the episode
(`announced_step`: when the alert goes out), not to its first flagged step. Recall comes with
a Wilson 95 % interval; episodes that match no injection are false alarms, per 1,000 steps, and
a clean run of the same length is scored too.

    .venv/bin/python benchmarks/detection_strength.py [--runs 2] [--kinds slow,comm_delay,memory_leak]
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from pathlib import Path

from _common import machine
from detection_quality import _bench_config, _run

from fixtures import recorded
from meshscope.collector.store import load_events, load_steps

STEPS = 240
ONSETS = (60, 120, 180)
LENGTH = 10
KINDS = {
    "slow": (
        "straggler",
        True,
        (1.1, 1.3, 1.5, 2.0, 3.0),
        "slow@step={step},rank={rank},steps=10,factor={s}",
    ),
    "comm_delay": ("comm", False, (5, 20, 50, 150), "comm_delay@step={step},rank={rank},steps=10,ms={s}"),
    "memory_leak": (
        "memory",
        True,
        (1, 4, 16),
        "memory_leak@step={step},rank={rank},steps=10,mb_per_step={s}",
    ),
}


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of a proportion."""
    if n == 0:
        return (math.nan, math.nan)
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def score_run(run: Path, type_: str, by_rank: bool) -> tuple[list[float | None], int, int]:
    """Per injection: the announcement delay (None: missed); false alarms; steps judged."""
    episodes = recorded.replay(run)
    injected = [d for d in load_events(run, kind="injected")["detail"]]
    delays: list[float | None] = []
    matched: set[int] = set()
    for inj in injected:
        lo, hi = inj["start_step"], inj["start_step"] + inj["steps"] + 5
        hits = [
            e
            for e in episodes
            if e.type == type_
            and e.start_step <= hi
            and e.end_step >= lo
            and (not by_rank or e.ranks == [inj["rank"]])
        ]
        matched |= {id(e) for e in hits}
        announced = [e.announced_step if e.announced_step is not None else e.start_step for e in hits]
        delays.append(max(0, min(announced) - lo) if hits else None)
    false = len([e for e in episodes if id(e) not in matched])
    return delays, false, int(load_steps(run)["step"].nunique())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2, help="fresh runs per kind and strength")
    ap.add_argument("--kinds", default=",".join(KINDS))
    args = ap.parse_args()
    config, root = _bench_config(), Path(tempfile.mkdtemp(prefix="strength-"))
    rows = []
    for kind in args.kinds.split(","):
        type_, by_rank, strengths, spec = KINDS[kind]
        for s in strengths:
            delays, false, steps = [], 0, 0
            for r in range(args.runs):
                specs = [spec.format(step=t, rank=(i + r) % 2, s=s) for i, t in enumerate(ONSETS)]
                run = _run(config, root, f"{kind}-{s}-{r}", STEPS, specs)
                d, f, n = score_run(run, type_, by_rank)
                delays, false, steps = delays + d, false + f, steps + n
            found = [d for d in delays if d is not None]
            lo, hi = wilson(len(found), len(delays))
            rows.append(
                f"| {kind} | {s} | {len(found)}/{len(delays)} | {len(found) / len(delays):.2f} "
                f"[{lo:.2f}, {hi:.2f}] | {statistics.median(found) if found else '—'} | "
                f"{1000 * false / max(steps, 1):.1f} |"
            )
            print(rows[-1], flush=True)
    clean_false, clean_steps = 0, 0
    for r in range(args.runs):
        _, f, n = score_run(_run(config, root, f"clean-{r}", STEPS, []), "none", False)
        clean_false, clean_steps = clean_false + f, clean_steps + n
    print(
        "\n| kind | strength | found | recall [95 % CI] | median delay to announcement (steps) "
        "| false alarms / 1,000 steps |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"clean: {clean_false} false alarm(s) in {clean_steps} steps")
    print(machine())


if __name__ == "__main__":
    main()
