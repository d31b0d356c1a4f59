"""`meshscope detect` on the Skoltech Anomaly Benchmark (SKAB), scored by SKAB's own code, beside
the detectors SKAB published and the baselines run here: a collection never tuned on.

SKAB (github.com/waico/SKAB) is 34 recordings of a water-pump testbed, 8 sensors a second, each
with one fault (a valve closed, a rotor imbalance, ...) labelled twice: `anomaly` on every row
of the faulty period, `changepoint` at its transitions (up to 4 a file). SKAB's protocol: the
first 400 rows of a file train, the rest are scored. Its two problems, scored by `chp_score`
from the checkout's `core/metrics.py` (not a copy; matplotlib, which it imports for plots only,
is stubbed):
- changepoints: NAB's scoring on a 60 s window to the right of each labelled changepoint
  (standard, LowFP and LowFN profiles; 0 = null detector, 100 = perfect);
- outliers: F1 (with false- and missed-alarm rates) of the rows flagged, as a binary
  classification. About half the scored rows are labelled, so flagging every row scores F1
  ~0.70: the "every row" line says so.

Detectors:
- meshscope's flags as `meshscope detect FILE.csv` writes them, at its defaults (no setting
  chosen on SKAB): episode onsets are its changepoints, `in_episode` its outlier rows;
- every score column read alike, with its best setting in hindsight (generous to each): onsets
  through the same hysteresis (`flag_episodes`) at the best sensitivity for changepoints, the
  best threshold for F1; and onsets at fixed sensitivities (`--at`: 1, the flags' default, and
  30, the flags' best on NAB's `tuned` split in `nab_quality.py`). meshscope's own score
  column is read the same way;
- run here on the same rows, one score per sensor combined by their maximum: the windowed
  Gaussian and scikit-learn's IsolationForest of `series_quality.py`, and a matrix-profile
  discord score (stumpy, offline);
- SKAB's published results (`results/*.pkl`, its outlier predictions; changepoints derived as
  SKAB's notebooks do), rescored here, beside the README's leaderboard figures: the check on
  this harness.

    git clone https://github.com/waico/SKAB /tmp/skab
    .venv/bin/python benchmarks/skab_quality.py --skab /tmp/skab
"""

from __future__ import annotations

import argparse
import contextlib
import io
import pickle
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from _common import machine
from nab_quality import discords
from series_quality import isolation_forest, windowed_gaussian

from meshscope.detectors.series import SeriesConfig, flag_episodes, score_frame

TRAIN_ROWS = 400  # SKAB's split (`core/utils.py`: train_test_split(train_size=400, shuffle=False))
CP_SCORING = {"metric": "nab", "window_width": "60s", "anomaly_window_destination": "righter"}
SENSITIVITIES = (0.1, 0.3, 1, 3, 10, 30, 100, 300, 1000, 3000, 5000)  # 5000: alpha at its cap
# notebooks whose changepoints are the edges of a 30-row rolling maximum of the rows flagged
ROLLING_MAX = {"Isolation_Forest": 30, "Arima_anomaly_detection": 30}
# SKAB's README leaderboard: NAB standard for changepoints, F1 for outliers
LEADERBOARD = {
    "MSCRED": (32.42, 0.36),
    "Isolation_Forest": (26.16, 0.29),
    "T2-q": (25.35, 0.76),
    "Conv_AE": (23.61, 0.78),
    "LSTM_AE": (23.51, 0.74),
    "T2": (19.54, 0.66),
    "MSET": (13.84, 0.78),
    "Vanilla_AE": (11.41, 0.39),
    "Vanilla_LSTM": (11.31, 0.54),
    "Arima_anomaly_detection": (-0.09, "-"),
}


@dataclass
class Recording:
    """One SKAB file: its sensors by time, and its two labels."""

    name: str
    sensors: pd.DataFrame
    anomaly: pd.Series
    changepoint: pd.Series

    @property
    def scored(self) -> pd.DatetimeIndex:
        """The rows SKAB scores (after its training rows)."""
        return self.sensors.index[TRAIN_ROWS:]


def load_corpus(skab: Path) -> list[Recording]:
    out = []
    for path in sorted((skab / "data").glob("*/*.csv")):
        if "anomaly-free" in path.parts:
            continue
        df = pd.read_csv(path, sep=";", index_col="datetime", parse_dates=True)
        out.append(
            Recording(
                f"{path.parent.name}/{path.name}",
                df.drop(columns=["anomaly", "changepoint"]),
                df["anomaly"].astype(int),
                df["changepoint"].astype(int),
            )
        )
    return out


def skab_scorer(skab: Path):
    """`chp_score` from the checkout, its plotting imports stubbed."""
    for name in ("matplotlib", "matplotlib.pyplot", "matplotlib.gridspec"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.path.insert(0, str(skab))
    from core.metrics import chp_score

    def score(true: list[pd.Series], predicted: list[pd.Series], **kwargs) -> object:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints as it scores
            return chp_score(true, predicted, **kwargs)

    return score


def scored_rows(files: list[Recording], rows: list[np.ndarray]) -> list[pd.Series]:
    """Per-row 0/1 over a whole file, cut to the rows SKAB scores."""
    return [pd.Series(np.asarray(r, int)[TRAIN_ROWS:], index=f.scored) for f, r in zip(files, rows)]


def judge(score, files: list[Recording], changepoints: list, outliers: list) -> dict[str, float]:
    """SKAB's changepoint NAB (three profiles) and outlier F1/FAR/MAR for whole-file 0/1 rows."""
    nab = score([f.changepoint.loc[f.scored] for f in files], scored_rows(files, changepoints), **CP_SCORING)
    true_rows = [f.anomaly.loc[f.scored] for f in files]
    f1, far, mar = score(true_rows, scored_rows(files, outliers), metric="binary")
    return {
        "NAB standard": nab["Standard"],
        "NAB LowFP": nab["LowFP"],
        "NAB LowFN": nab["LowFN"],
        "F1": f1,
        "FAR %": far,
        "MAR %": mar,
    }


def read_in_hindsight(
    score, files: list[Recording], scores: list[np.ndarray], at: tuple[float, ...]
) -> dict[str, object]:
    """A score column at its best setting for each problem: onsets through the hysteresis at
    the best sensitivity (changepoints), rows over the best threshold (outliers)."""
    no_rows = [np.zeros(len(s)) for s in scores]
    by_sensitivity = {}
    for sens in sorted({*SENSITIVITIES, *at}):
        config = SeriesConfig.with_sensitivity(sens)
        onsets = [flag_episodes(1.0 - s, config)[0] for s in scores]
        by_sensitivity[sens] = judge(score, files, onsets, no_rows)
    best_sens = max(SENSITIVITIES, key=lambda sens: by_sensitivity[sens]["NAB standard"])
    pooled = np.concatenate([s[TRAIN_ROWS:] for s in scores])
    by_threshold = {
        t: judge(score, files, no_rows, [s >= t for s in scores])
        for t in np.unique(np.quantile(pooled, np.linspace(0, 0.999, 80)))
    }
    best_t = max(by_threshold, key=lambda t: by_threshold[t]["F1"])
    row = {k: v for k, v in by_sensitivity[best_sens].items() if k.startswith("NAB")}
    row.update({k: v for k, v in by_threshold[best_t].items() if not k.startswith("NAB")})
    row["setting"] = f"sensitivity {best_sens:g}; rows >= {best_t:.4g}"
    row.update({f"NAB standard at {sens:g}": by_sensitivity[sens]["NAB standard"] for sens in at})
    return row


def by_sensor(fn, files: list[Recording]) -> list[np.ndarray]:
    """A univariate baseline on every sensor of a file, combined by the maximum."""
    return [np.max(np.column_stack([fn(col) for col in f.sensors.to_numpy(float).T]), axis=1) for f in files]


def published(skab: Path, files: list[Recording]) -> dict[str, tuple[list, list]]:
    """SKAB's published outlier predictions, matched to files by their last time (sequence
    models start late), and the changepoints each notebook derives from them: the edges of the
    rows flagged, after a 30-row rolling maximum for two of them."""
    end = {f.scored[-1]: i for i, f in enumerate(files)}
    out = {}
    for path in sorted((skab / "results").glob("results-*.pkl")):
        name = path.stem.removeprefix("results-")
        outliers: list[np.ndarray] = [np.zeros(len(f.sensors)) for f in files]
        changepoints: list[np.ndarray] = [np.zeros(len(f.sensors)) for f in files]
        for series in pickle.loads(path.read_bytes()):
            i = end.get(series.index[-1])
            if i is None:
                continue
            rows = series.astype(float)
            edges = rows.rolling(ROLLING_MAX.get(name, 1)).max().fillna(0).diff().abs()
            edges.iloc[0] = rows.iloc[0]
            for kept, got in ((outliers, rows), (changepoints, edges)):
                kept[i][TRAIN_ROWS:] = got.reindex(files[i].scored).fillna(0).to_numpy()
        out[name] = (changepoints, outliers)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skab", type=Path, required=True, help="a SKAB checkout (data/, core/, results/)")
    parser.add_argument(
        "--at",
        type=float,
        nargs="+",
        default=[1.0, 30.0],
        help="sensitivities every score is also read at (1: our default; 30: our flags' best on NAB's tuned)",
    )
    args = parser.parse_args()
    at = tuple(args.at)
    if not all(sens > 0 for sens in at):
        parser.error(f"--at: sensitivities must be > 0, got {list(at)}")
    files = load_corpus(args.skab)
    if not files or not (args.skab / "core" / "metrics.py").is_file():
        parser.error(f"--skab: {args.skab} is not a SKAB checkout (data/*/*.csv and core/metrics.py)")
    score = skab_scorer(args.skab)
    rows = []
    t0 = time.perf_counter()
    ours = [score_frame(f.sensors.reset_index(), "datetime") for f in files]
    took = time.perf_counter() - t0
    onsets, episodes = [o["is_anomaly"].to_numpy() for o in ours], [o["in_episode"].to_numpy() for o in ours]
    flags = judge(score, files, onsets, episodes)
    for sens in at:
        rerun = [score_frame(f.sensors.reset_index(), "datetime", sensitivity=sens) for f in files]
        changepoints = [o["is_anomaly"].to_numpy() for o in rerun]
        flags[f"NAB standard at {sens:g}"] = judge(score, files, changepoints, episodes)["NAB standard"]
    rows.append({"detector": "meshscope detect: its flags", "setting": "defaults", **flags, "seconds": took})
    columns = {"meshscope detect: its score column": ([o["anomaly_score"].to_numpy() for o in ours], took)}
    baselines = {
        "windowed Gaussian (run here)": windowed_gaussian,
        "IsolationForest (run here, online)": isolation_forest,
    }
    try:
        import stumpy  # noqa: F401

        baselines["matrix profile, stumpy (run here, offline)"] = discords
    except ImportError:
        print("stumpy is not installed: `pip install stumpy` adds the matrix profile", file=sys.stderr)
    for name, fn in baselines.items():
        t0 = time.perf_counter()
        columns[name] = (by_sensor(fn, files), time.perf_counter() - t0)
    for name, (scores, secs) in columns.items():
        rows.append({"detector": name, **read_in_hindsight(score, files, scores, at), "seconds": secs})
    for name, (changepoints, outliers) in published(args.skab, files).items():
        row = {"detector": f"SKAB published: {name}", "setting": "as published"}
        row.update(judge(score, files, changepoints, outliers))
        row["leaderboard NAB / F1"] = "{} / {}".format(*LEADERBOARD.get(name, ("-", "-")))
        rows.append(row)
    nothing, everything = [np.zeros(len(f.sensors)) for f in files], [np.ones(len(f.sensors)) for f in files]
    rows.append({"detector": "every row flagged", "setting": "-", **judge(score, files, nothing, everything)})
    with pd.option_context("display.width", 250, "display.max_columns", 20, "display.max_colwidth", 60):
        print(pd.DataFrame(rows).round(2).to_string(index=False))
    print(f"{len(files)} files; {machine()}")


if __name__ == "__main__":
    main()
