"""Workers with two step-time modes: quiet while the mix holds, and a change of mix told.

Per-worker step-time traces of 16 workers, each in a fast mode (0.5 s) and a slower one
(0.8 s) on 30 % of its steps at random, as some production jobs' workers alternate. In each
faulty trace one worker's slower mode becomes its usual one (`--share` of its steps, from step
250 to `--until`); every step it takes is still one of its known modes. Fed to the engine as
`meshscope detect --run` feeds it (chunks of 10 steps). Printed per seed: the episodes, and
over all seeds the recall, the delay from step 250, how long after the mix returned the last
episode ended, episodes naming another worker, and episodes on the clean traces.

    .venv/bin/python benchmarks/mode_mix.py [--seeds 8] [--share 0.9] [--until 330]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import pandas as pd
from _common import machine

from meshscope.detectors.engine import DetectionEngine
from meshscope.detectors.thresholds import EngineConfig

WORKERS, STEPS, CHANGED, ONSET = 16, 450, 3, 250


def trace(seed: int, share: float, until: int) -> pd.DataFrame:
    """One trace; `share` of worker CHANGED's steps in its slower mode from ONSET to `until`."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(STEPS):
        usual = np.where((np.arange(WORKERS) == CHANGED) & (ONSET <= step < until), share, 0.3)
        step_s = (
            0.5 * (1 + 0.05 * rng.standard_normal(WORKERS)) * np.where(rng.random(WORKERS) < usual, 1.6, 1.0)
        )
        rows += [
            dict(rank=r, world_size=WORKERS, step=step, step_s=step_s[r], data_s=0.0, comm_exposed_s=0.0,
                 comm_ratio=0.0, bytes_wire=0, loss=np.nan, grad_norm=np.nan, tokens=0, mem_rss=0.0,
                 mem_allocated=0.0)
            for r in range(WORKERS)
        ]  # fmt: skip
    return pd.DataFrame(rows)


def episodes(df: pd.DataFrame) -> list:
    """The closed episodes, judged as a tailing judge does (chunks of 10 steps)."""
    closed = []
    engine = DetectionEngine(EngineConfig(), on_close=closed.append)
    for end in range(10, STEPS + 10, 10):
        engine.process(df[df["step"] < end])
    engine.finish()
    return closed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--share", type=float, default=0.9, help="the changed worker's slower-mode share")
    ap.add_argument("--until", type=int, default=330, help="the step its usual mix returns")
    args = ap.parse_args()
    print(f"machine: {machine()}")
    found, delays, ends, others, clean = 0, [], [], 0, 0
    for seed in range(7, 7 + args.seeds):
        faulty = [
            (e.type, e.ranks, e.start_step, e.end_step) for e in episodes(trace(seed, args.share, args.until))
        ]
        quiet = episodes(trace(seed, 0.3, args.until))
        print(f"seed {seed}: {faulty}; clean: {len(quiet)} episode(s)")
        mine = [e for e in faulty if e[1] == [CHANGED]]
        others += len(faulty) - len(mine)
        clean += len(quiet)
        if mine:
            found += 1
            delays.append(mine[0][2] - ONSET)
            ends.append(mine[-1][3] - args.until)
    print(
        f"told {found}/{args.seeds}; delay median {statistics.median(delays) if delays else '-'} "
        f"(max {max(delays) if delays else '-'}) steps; last episode ended "
        f"{statistics.median(ends) if ends else '-'} (max {max(ends) if ends else '-'}) steps after "
        f"the mix returned; episodes naming another worker {others}; episodes on clean traces {clean}"
    )


if __name__ == "__main__":
    main()
