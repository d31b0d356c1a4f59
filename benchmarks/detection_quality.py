"""How well the detectors find labelled faults, against two baselines, and what a step costs.

Recorded runs (fixtures/stores/<name>/store.sqlite, recorded once with `--record`): two clean
runs and one run per injection kind, on 2 CPU ranks. The `injected` events are the ground truth.
Scoring replays the stores in seconds:
  * ours: detectors.engine.DetectionEngine (as `meshscope run` and `meshscope detect` use it);
  * static threshold: a step slower than 2x the warm-up median, loss non-finite, memory +100 MB;
  * batch IsolationForest on raw per-step features (scikit-learn defaults, whole run at once).
Per kind: recall, precision, F1, detection delay (steps), and false alarms per 1,000 clean steps.
Cost: judging one step of 1,024 ranks after warm-up.

    .venv/bin/python benchmarks/detection_quality.py [--record [RUN...]] [--long-clean 15000]
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
from _common import REPO, machine
from sklearn.ensemble import IsolationForest

from fixtures import recorded
from meshscope.collector.store import load_events, load_steps
from meshscope.detectors.engine import DetectionEngine
from meshscope.detectors.episodes import Episode, EpisodeTracker

DATA = recorded.STORES
START, RUNS, HELD_OUT, EXPECTED = recorded.START, recorded.DETECTION, recorded.HELD_OUT, recorded.ANOMALIES


def _bench_config() -> Path:
    config = Path(tempfile.mkdtemp()) / "bench.toml"
    config.write_text(
        (REPO / "fixtures/tiny.toml")
        .read_text()
        .replace("d_model = 32", "d_model = 64")
        .replace("batch_size = 8", "batch_size = 16")
    )
    return config


def _run(
    config: Path, root: Path, name: str, steps: int, injections: list[str], flags: tuple[str, ...] = ()
) -> Path:
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
        "--metrics-port",
        "9870",
        *flags,
    ]
    for spec in injections:
        cmd += ["--inject", spec]
    subprocess.run(cmd, cwd=REPO, check=not flags, capture_output=True)  # an abort may end it in error
    return root / name


def record(steps: int = 150, only: list[str] | None = None) -> None:
    config = _bench_config()
    for name, injections in {**RUNS, **HELD_OUT}.items():
        if only and name not in only:
            continue
        root = Path(tempfile.mkdtemp())
        _run(config, root, name, steps, injections)
        (DATA / name).mkdir(parents=True, exist_ok=True)
        src = sqlite3.connect(root / name / "store.sqlite")
        dst = sqlite3.connect(DATA / name / "store.sqlite")
        src.backup(dst)  # one compact file, WAL folded in
        dst.execute("DELETE FROM events WHERE kind = 'anomaly'")  # replay judges afresh
        dst.commit()
        dst.execute("PRAGMA journal_mode=DELETE")  # one file in git; readers add no -wal/-shm
        src.close()
        dst.close()
        print(f"recorded {name}")


def ours(run: Path) -> list[Episode]:
    """Our engine's episodes over a recorded run."""
    return recorded.replay(run)


def _episodes(flags: pd.Series, type_: str) -> list[Episode]:
    tracker, out = EpisodeTracker(gap=3), []
    for step, flagged in flags.items():
        if flagged:
            tracker.flag(int(step), type_, 1.0)
        out += tracker.close_quiet(int(step))
    return out + tracker.close_all()


def static_threshold(run: Path) -> list[Episode]:
    s = load_steps(run)
    g = s.groupby("step")
    step_s, rss = g["step_s"].max(), g["mem_rss"].max()
    warm = step_s.iloc[:20].median()
    return (
        _episodes(step_s > 2 * warm, "straggler")
        + _episodes(~g["loss"].apply(lambda v: np.isfinite(v).all()), "nan")
        + _episodes(rss > rss.iloc[:20].median() + 100 * 2**20, "memory")
    )


def batch_forest(run: Path) -> list[Episode]:
    s = load_steps(run)
    raw = s.groupby("step")[["step_s", "comm_exposed_s", "loss", "grad_norm", "mem_rss"]].max()
    raw = raw.replace([np.inf, -np.inf], np.nan).fillna(0.0)
    flags = pd.Series(IsolationForest(random_state=0).fit_predict(raw) < 0, index=raw.index)
    return _episodes(flags, "multivariate")


def score(method, runs: list[str]) -> dict[str, dict[str, float]]:
    out = {}
    clean_steps = clean_alarms = 0
    for name in runs:
        path = DATA / name
        episodes = method(path)
        if name.startswith("clean"):
            clean_steps += load_steps(path)["step"].nunique()
            clean_alarms += len(episodes)
            continue
        inj = load_events(path, kind="injected")["detail"].iloc[0]
        end = inj["start_step"] + inj["steps"] + 5
        kind = name.removesuffix("-2")
        expected = EXPECTED[kind]
        if method is not ours:  # baselines have coarse types: any alarm in the window counts
            expected = {e.type for e in episodes}
        hits = [
            e
            for e in episodes
            if e.type in expected and e.start_step <= end and e.end_step >= inj["start_step"]
        ]
        tp = 1 if hits else 0
        fp = len([e for e in episodes if e not in hits])
        precision = tp / (tp + fp) if tp + fp else 0.0
        f1 = 2 * precision * tp / (precision + tp) if precision + tp else 0.0
        delay = min(e.start_step for e in hits) - inj["start_step"] if hits else float("nan")
        out[kind] = {"recall": tp, "precision": precision, "f1": f1, "delay": delay}
    out["clean"] = {"false_alarms_per_1000": 1000 * clean_alarms / max(clean_steps, 1)}
    return out


def cost_per_step(ranks: int = 1024, warmup: int = 80, measured: int = 30) -> float:
    """Median seconds to judge one more step of `ranks` ranks once every detector is live
    (the persistent-straggler horizons need 50 normal steps after the 20 of warm-up), given
    the new step's rows as the live path reads them from the store."""
    rng = np.random.default_rng(0)
    rows = []
    for step in range(warmup + measured):
        c = 0.1 * (1 + 0.03 * rng.standard_normal(ranks))
        rows.append(
            pd.DataFrame(
                {
                    "rank": np.arange(ranks),
                    "world_size": ranks,
                    "step": step,
                    "step_s": c.max(),
                    "data_s": 0.0,
                    "comm_exposed_s": c.max() - c,
                    "comm_ratio": (c.max() - c) / c.max(),
                    "bytes_wire": 1000,
                    "loss": 3.0,
                    "grad_norm": 1.0,
                    "tokens": 256,
                    "mem_rss": 1e9,
                    "nonfinite": "",  # as the store has it: the scalars no rank found non-finite
                }
            )
        )
    engine = DetectionEngine()
    engine.process(pd.concat(rows[:warmup]))
    times = []
    for new in rows[warmup:]:
        t0 = time.perf_counter()
        engine.process(new)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def long_clean(steps: int) -> None:
    """False alarms on one long clean run, recorded now (too big to keep in git). With none in
    N steps, the rate is below 3/N at 95 % confidence (the rule of three)."""
    run = _run(_bench_config(), Path(tempfile.mkdtemp()), "long-clean", steps, [])
    judged = load_steps(run)["step"].nunique()
    print(f"\nlong clean run: {judged} steps of 2 ranks")
    for label, method in (
        ("ours", ours),
        ("static threshold", static_threshold),
        ("batch IsolationForest", batch_forest),
    ):
        episodes = method(run)
        bound = f"; < {3000 / judged:.2f} per 1,000 at 95 %" if not episodes else ""
        print(
            f"  {label:22} {len(episodes)} false alarms = {1000 * len(episodes) / judged:.2f} "
            f"per 1,000 steps{bound}"
        )
        for ep in episodes[:10]:
            print(f"    {ep.type} steps {ep.start_step}-{ep.end_step} ranks {ep.ranks} {ep.evidence}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--record",
        nargs="*",
        metavar="RUN",
        default=None,
        help="record the runs again (all, or the ones named)",
    )
    ap.add_argument(
        "--long-clean",
        type=int,
        default=0,
        metavar="STEPS",
        help="also record and judge one clean run of STEPS steps (false-alarm rate)",
    )
    ap.add_argument(
        "--cost-only", action="store_true", help="only the judging cost, at 1,024 and 16,384 ranks"
    )
    args = ap.parse_args()
    if args.cost_only:
        print(f"machine: {machine()}")
        for ranks, target in ((1024, 5), (16384, 20)):
            print(
                f"cost: one step of {ranks:,} ranks judged in {cost_per_step(ranks) * 1e3:.1f} ms "
                f"(target <= {target} ms)"
            )
        return
    missing = [n for n in {**RUNS, **HELD_OUT} if not (DATA / n / "store.sqlite").exists()]
    if args.record is not None or missing:
        record(only=args.record or missing)
    print(f"machine: {machine()}")
    for title, names in (("tuning set", list(RUNS)), ("held-out set", list(HELD_OUT))):
        print(f"\n=== {title}: {', '.join(names)}")
        for label, method in (
            ("ours", ours),
            ("static threshold", static_threshold),
            ("batch IsolationForest", batch_forest),
        ):
            result = score(method, names)
            print(
                f"\n{label}: false alarms per 1,000 clean steps "
                f"{result.pop('clean')['false_alarms_per_1000']:.1f}"
            )
            for kind, r in result.items():
                print(
                    f"  {kind:16} recall {r['recall']:.0f}  precision {r['precision']:.2f}  "
                    f"F1 {r['f1']:.2f}  delay {r['delay']:.0f} steps"
                )
    print(f"\ncost: one step of 1,024 ranks judged in {cost_per_step() * 1e3:.1f} ms (target <= 5 ms)")
    if args.long_clean:
        long_clean(args.long_clean)


if __name__ == "__main__":
    main()
