"""Several stragglers at once, against strength and count, on runs recorded now.

`detection_strength.py` slows one rank of two. Here 4 CPU ranks share this machine's cores
(oversubscribed on 2 cores, as the recorded `fixtures/stores/phases` runs are) and 1, 2 or 3
of them are slowed together (`slow@...,factor=F`) over steps 60-99 of a 160-step run: the
case where the slow ranks' peers absorb the wait inside DDP's reduction and, with three, the
job's median is the slow half. Every run is fresh (recorded into a temporary folder at
benchmark time; nothing was tuned on it) and judged as `meshscope detect --run` judges it
(against the host the run recorded). Per count and strength: slow ranks named (recall, with a
Wilson 95 % interval), ranks named that were not slow (wrong culprits), the median delay from
the onset to the first flagged step and to the announcement, and how far after the fault's
last step the episodes end. Clean runs of the same length are scored too.

    .venv/bin/python benchmarks/stragglers.py [--runs 1] [--counts 1,2,3] [--factors 1.1,1.3,1.5,2,3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _common import REPO, machine
from detection_quality import _run
from detection_strength import wilson

from fixtures import recorded

STEPS, ONSET, LAST = 160, 60, 99
SLOW_RANKS = {1: (3,), 2: (1, 2), 3: (0, 1, 3)}


def _config() -> Path:
    """The tests' tiny model on 4 ranks (the fixtures' recordings use the same)."""
    config = Path(tempfile.mkdtemp()) / "four.toml"
    config.write_text((REPO / "fixtures/tiny.toml").read_text().replace("nproc = 2", "nproc = 4"))
    return config


def score(run: Path, slow: tuple[int, ...]) -> dict:
    """Named slow ranks, wrong ranks, delays and end lags of one run's straggler episodes."""
    episodes = [e for e in recorded.replay(run, on_its_host=True) if e.type == "straggler"]
    named = {r for e in episodes for r in e.ranks}
    mine = [e for e in episodes if set(e.ranks) <= set(slow) and e.end_step >= ONSET]
    return {
        "found": len(named & set(slow)),
        "wrong": sorted(named - set(slow)),
        "first": [e.start_step - ONSET for e in mine],
        "announced": [(e.announced_step or e.start_step) - ONSET for e in mine],
        "end": [e.end_step - LAST for e in mine],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1, help="fresh runs per count and strength")
    ap.add_argument("--counts", default="1,2,3", help="how many of the 4 ranks are slow")
    ap.add_argument("--factors", default="1.1,1.3,1.5,2,3")
    args = ap.parse_args()
    config, root = _config(), Path(tempfile.mkdtemp(prefix="stragglers-"))
    rows = []
    for count in map(int, args.counts.split(",")):
        slow = SLOW_RANKS[count]
        for factor in args.factors.split(","):
            got: dict = {"found": 0, "wrong": [], "first": [], "announced": [], "end": []}
            for r in range(args.runs):
                specs = [f"slow@step={ONSET},rank={k},steps={LAST - ONSET + 1},factor={factor}" for k in slow]
                one = score(_run(config, root, f"k{count}-{factor}-{r}", STEPS, specs), slow)
                got = {k: got[k] + (one[k] if isinstance(one[k], list) else one[k]) for k in got}
            total = count * args.runs
            lo, hi = wilson(got["found"], total)
            rows.append(
                f"| {count} of 4 | ×{factor} | {got['found']}/{total} | {got['found'] / total:.2f} "
                f"[{lo:.2f}, {hi:.2f}] | {len(got['wrong'])} {sorted(set(got['wrong'])) or ''} | "
                f"{_median(got['first'])} | {_median(got['announced'])} | {_median(got['end'])} |"
            )
            print(rows[-1], flush=True)
    clean_wrong = []
    for r in range(args.runs * 2):
        clean_wrong += score(_run(config, root, f"clean-{r}", STEPS, []), ())["wrong"]
    print(
        "\n| slow ranks | strength | named | recall [95 % CI] | wrong ranks named | median first "
        "flag (steps after onset) | median announcement | median end after the fault |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"clean: {len(clean_wrong)} rank(s) named in {args.runs * 2} runs of {STEPS} steps")
    print(machine())


def _median(values: list[int]) -> str:
    return f"{statistics.median(values):g}" if values else "—"


if __name__ == "__main__":
    main()
