"""`meshscope detect FILE.csv` on labelled series: episodes found, false flags, against a
windowed Gaussian and scikit-learn's IsolationForest in the same run.

The suite is generated (seeded) in the shapes exported metrics take: white noise, an AR(1)
wander, a quantised counter, heavy tails, a slow trend, a noiseless daily pattern, a square
wave, a flat line, daily patterns with noise and with a season that is not a whole number of
rows; half clean, half with one or two anomalies (spike, level shift up/down, trend change,
variance change, a stuck sensor, a missing daily peak, a larger day, a missing pulse, a counter
stuck at zero, and a larger anomaly after a smaller 30-row episode: a spike, or a larger
episode). 4,032 rows each (two weeks at 5 minutes, 288 rows a day).

Scored the way labelled-window benchmarks do: a window of 10 % of the series (split between its
anomalies) centred on each onset; the first 15 % of rows are probation (not scored). Per
detector: episode recall (windows with a flag), precision (detected windows over detected
windows plus flags outside every window), false flags per 1,000 scored rows (all series, and
clean series alone), and a window score (first flag in a window earns up to 1, earlier more;
each false flag costs 0.11; a missed window costs 1; normalised so flagging nothing is 0 and a
perfect detector 100).

The baselines are read three ways: every row over their threshold (as those benchmarks run them),
at the same tail probability as ours and at their best threshold in hindsight; and onsets only,
through the same hysteresis ours uses (`detectors.series.flag_episodes`), so flags are counted
alike.

    .venv/bin/python benchmarks/series_quality.py [--seeds 3] [--csv-dir DIR]

`--csv-dir` also scores a folder of labelled CSVs (columns timestamp,value; labels in a
`labels.json` mapping file name to a list of onset row numbers), e.g. a public benchmark's
files converted so.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from _common import machine
from sklearn.ensemble import IsolationForest

from meshscope.detectors.series import SeriesConfig, flag_episodes, score_frame

N, DAY = 4032, 288
PROBATION = 0.15


@dataclass
class Series:
    """One labelled series: its values and the rows where anomalies begin."""

    name: str
    values: np.ndarray
    onsets: list[int] = field(default_factory=list)


def _daily(n: int, period: float = DAY, low: float = 20.0, high: float = 80.0) -> np.ndarray:
    phase = (np.arange(n) % period) / period
    ramp = np.clip((np.sin(2 * np.pi * (phase - 0.25)) + 0.3) * 2, 0, 1)  # flat nights, ramps
    return low + (high - low) * ramp


def _square(n: int, period: int = DAY) -> np.ndarray:
    return np.where((np.arange(n) % period) < period // 2, 20.0, 80.0)


def clean_bases(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The clean shapes, each with no anomaly at all."""
    ar = np.zeros(N)
    noise = rng.normal(0, 1, N)
    for i in range(1, N):
        ar[i] = 0.9 * ar[i - 1] + noise[i]
    return {
        "white_noise": 50 + rng.normal(0, 2, N),
        "ar1": 40 + ar,
        "counter": rng.poisson(3, N).astype(float),
        "heavy_tails": 10 + rng.standard_t(3, N),
        "trend": 10 + 0.005 * np.arange(N) + rng.normal(0, 0.5, N),
        "daily_no_noise": _daily(N),
        "square_wave": _square(N),
        "flatline": np.full(N, 50.0),
        "daily_noise": _daily(N) + rng.normal(0, 2, N),
        "daily_fractional": _daily(N, period=287.5) + rng.normal(0, 1, N),
    }


def _onset(rng: np.random.Generator, lo: float = 0.3, hi: float = 0.85) -> int:
    return int(rng.integers(int(lo * N), int(hi * N)))


def anomalous(rng: np.random.Generator) -> list[Series]:
    """One series per anomaly kind, on the base where it shows in practice."""
    b = clean_bases(rng)
    out = []

    def add(name: str, values: np.ndarray, *onsets: int) -> None:
        out.append(Series(name, values, sorted(onsets)))

    x, t = b["white_noise"].copy(), _onset(rng)
    x[t] += 25
    add("spike", x, t)
    x, t1, t2 = b["ar1"].copy(), _onset(rng, 0.3, 0.55), _onset(rng, 0.6, 0.9)
    x[t1] += 15
    x[t2] -= 15
    add("spikes_ar1", x, t1, t2)
    x, t = b["white_noise"].copy(), _onset(rng)
    x[t:] += 10
    add("level_up", x, t)
    x, t = b["daily_noise"].copy(), _onset(rng)
    x[t:] -= 25
    add("level_down_daily", x, t)
    x, t = b["trend"].copy(), _onset(rng)
    x[t:] += 0.2 * np.arange(N - t)
    add("trend_change", x, t)
    x, t = b["white_noise"].copy(), _onset(rng)
    x[t:] = 50 + (x[t:] - 50) * 5
    add("variance_up", x, t)
    x, t = b["white_noise"].copy(), _onset(rng)
    x[t : t + 300] = x[t - 1]
    add("stuck_sensor", x, t)
    x = b["daily_no_noise"].copy()
    day = int(rng.integers(5, 12))
    t = day * DAY + DAY // 4
    x[t : t + DAY // 2] = x[t]
    add("missing_peak", x, t)
    x, t = b["daily_noise"].copy(), int(rng.integers(5, 12)) * DAY
    x[t : t + DAY] = 20 + (x[t : t + DAY] - 20) * 1.6
    add("larger_day", x, t + int(np.argmax(x[t : t + DAY] > 82)))
    x = b["square_wave"].copy()
    t = int(rng.integers(5, 12)) * DAY + DAY // 2
    x[t : t + DAY // 2] = 20
    add("missing_pulse", x, t)
    x, t = b["counter"].copy(), _onset(rng)
    x[t : t + 200] = 0
    add("counter_stuck_at_zero", x, t)
    x, t = b["heavy_tails"].copy(), _onset(rng)
    x[t:] += 8
    add("level_up_heavy_tails", x, t)
    # a larger anomaly after a smaller one: the scale must not have learnt the first
    sd = float(np.std(b["white_noise"]))
    for name, small, large in (("spike_after_episode", 20, 75), ("larger_episode_after_episode", 8, 25)):
        x, t1, t2 = b["white_noise"].copy(), _onset(rng, 0.3, 0.5), _onset(rng, 0.65, 0.9)
        x[t1 : t1 + 30] += small * sd
        if name.startswith("spike"):
            x[t2] += large * sd
        else:
            x[t2 : t2 + 30] += large * sd
        add(name, x, t1, t2)
    return out


def suite(seeds: int) -> list[Series]:
    """Clean and anomalous series for each seed."""
    out = []
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        out += [Series(f"{k}#{seed}", v) for k, v in clean_bases(rng).items()]
        out += [Series(f"{s.name}#{seed}", s.values, s.onsets) for s in anomalous(rng)]
    return out


# ---- detectors: each returns per-row scores in [0, 1] and its flags at a threshold


def ours(x: np.ndarray, config: SeriesConfig) -> tuple[np.ndarray, np.ndarray]:
    scored = score_frame(pd.DataFrame({"t": np.arange(len(x)), "v": x}), "t", config=config)
    return scored["anomaly_score"].to_numpy(), scored["is_anomaly"].to_numpy()


def windowed_gaussian(x: np.ndarray, window: int = 6400, step: int = 100) -> np.ndarray:
    """The classic baseline: the tail probability of each row under the mean and standard
    deviation of the rows before it (a trailing window, refreshed every `step` rows)."""
    scores = np.zeros(len(x))
    mean = std = None
    for i in range(len(x)):
        if i >= 2 and (mean is None or i % step == 0):
            past = x[max(0, i - window) : i]
            mean, std = float(past.mean()), float(past.std())
        if mean is None:
            continue
        z = abs(x[i] - mean) / max(std, 1e-12)
        scores[i] = 1 - math.erfc(z / math.sqrt(2))
    return scores


def isolation_forest(x: np.ndarray, refit: int = 500, history: int = 2000) -> np.ndarray:
    """scikit-learn's IsolationForest, online: refit every `refit` rows on the rows before,
    on (value, change); the score is the share of the past's scores below this row's."""
    feats = np.column_stack([x, np.r_[0.0, np.diff(x)]])
    scores = np.zeros(len(x))
    start = int(PROBATION * len(x))
    for lo in range(start, len(x), refit):
        past = feats[max(0, lo - history) : lo]
        model = IsolationForest(n_estimators=50, random_state=0).fit(past)
        ref = np.sort(-model.score_samples(past))
        now = -model.score_samples(feats[lo : lo + refit])
        scores[lo : lo + refit] = np.searchsorted(ref, now, side="right") / (len(ref) + 1)
    return scores


# ---- scoring


def windows(s: Series) -> list[tuple[int, int]]:
    if not s.onsets:
        return []
    width = int(0.1 * len(s.values) / len(s.onsets))
    return [(max(0, t - width // 2), min(len(s.values), t + width // 2)) for t in s.onsets]


def judge(s: Series, flags: np.ndarray) -> dict[str, float]:
    """Windows found, false flags and the window score of one series' flags."""
    start = int(PROBATION * len(flags))
    rows = np.flatnonzero(flags)
    rows = rows[rows >= start]
    wins = windows(s)
    inside = np.zeros(len(flags), bool)
    found, raw = 0, 0.0
    for lo, hi in wins:
        inside[lo:hi] = True
        hits = rows[(rows >= lo) & (rows < hi)]
        if len(hits):
            found += 1
            rel = (hits[0] - hi + 1) / (hi - lo)  # -1 at the window's start, 0 at its end
            raw += 2 / (1 + math.exp(5 * rel)) - 1  # NAB's scaled sigmoid: 1 early, ~0 late
        else:
            raw -= 1.0
    false = int((~inside[rows]).sum())
    raw -= 0.11 * false
    return {
        "windows": len(wins),
        "found": found,
        "false": false,
        "rows": len(flags) - start,
        "raw": raw,
        "null": -float(len(wins)),
        "perfect": float(len(wins)),
    }


def summarise(results: list[dict[str, float]], clean: list[bool]) -> dict[str, float]:
    tot = {k: sum(r[k] for r in results) for k in results[0]}
    clean_false = sum(r["false"] for r, c in zip(results, clean, strict=True) if c)
    clean_rows = sum(r["rows"] for r, c in zip(results, clean, strict=True) if c)
    span = tot["perfect"] - tot["null"]
    return {
        "recall": tot["found"] / max(tot["windows"], 1),
        "precision": tot["found"] / max(tot["found"] + tot["false"], 1),
        "false_per_1000": 1000 * tot["false"] / tot["rows"],
        "clean_false_per_1000": 1000 * clean_false / max(clean_rows, 1),
        "score": 100 * (tot["raw"] - tot["null"]) / span if span else float("nan"),
    }


def best_in_hindsight(series: list[Series], scores: list[np.ndarray]) -> tuple[float, dict]:
    clean = [not s.onsets for s in series]
    best = (-math.inf, {}, 0.0)
    for thr in [0.9, 0.95, 0.99, 0.995, 0.999, 0.9995, 0.9999, 0.99999, 0.999999]:
        summary = summarise([judge(s, sc >= thr) for s, sc in zip(series, scores, strict=True)], clean)
        if summary["score"] > best[0]:
            best = (summary["score"], summary, thr)
    return best[2], best[1]


def evaluate(series: list[Series], label: str) -> list[dict]:
    config = SeriesConfig()
    rows: list[dict] = []
    clean = [not s.onsets for s in series]
    t0 = time.perf_counter()
    ours_flags = [ours(s.values, config)[1] for s in series]
    ours_s = time.perf_counter() - t0
    rows.append(
        {
            "set": label,
            "detector": "meshscope detect (default)",
            "threshold": "onsets",
            **summarise([judge(s, f) for s, f in zip(series, ours_flags, strict=True)], clean),
            "seconds": ours_s,
        }
    )
    same = 1 - config.alpha
    for name, fn in [("windowed Gaussian", windowed_gaussian), ("IsolationForest", isolation_forest)]:
        t0 = time.perf_counter()
        scores = [fn(s.values) for s in series]
        took = time.perf_counter() - t0
        rows.append(
            {
                "set": label,
                "detector": name,
                "threshold": f"{same}",
                **summarise([judge(s, sc >= same) for s, sc in zip(series, scores, strict=True)], clean),
                "seconds": took,
            }
        )
        thr, summary = best_in_hindsight(series, scores)
        rows.append(
            {"set": label, "detector": name, "threshold": f"{thr} (hindsight)", **summary, "seconds": took}
        )
        # the same onsets-only reading ours gets: one flag per episode, by the same hysteresis
        onsets = [flag_episodes(1.0 - sc, config)[0] for sc in scores]
        rows.append(
            {
                "set": label,
                "detector": name,
                "threshold": f"{same}, onsets",
                **summarise([judge(s, f) for s, f in zip(series, onsets, strict=True)], clean),
                "seconds": took,
            }
        )
    return rows


def read_csv_dir(folder: Path) -> list[Series]:
    labels = json.loads((folder / "labels.json").read_text())
    out = []
    for path in sorted(folder.glob("*.csv")):
        values = pd.read_csv(path)["value"].to_numpy(float)
        out.append(Series(path.stem, values, list(labels.get(path.name, []))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--csv-dir", type=Path)
    parser.add_argument("--per-series", action="store_true", help="ours: flags per series")
    args = parser.parse_args()
    series = suite(args.seeds)
    rows = evaluate(series, f"generated ({len(series)} series)")
    if args.csv_dir:
        extra = read_csv_dir(args.csv_dir)
        rows += evaluate(extra, f"{args.csv_dir.name} ({len(extra)} series)")
    if args.per_series:
        config = SeriesConfig()
        for s in series:
            flags = ours(s.values, config)[1]
            j = judge(s, flags)
            print(
                f"{s.name:28s} windows {j['windows']} found {j['found']} false {j['false']}"
                f"  flags at {np.flatnonzero(flags)[:8].tolist()} onsets {s.onsets}"
            )
    table = pd.DataFrame(rows)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.round(3).to_string(index=False))
    print(machine())


if __name__ == "__main__":
    main()
