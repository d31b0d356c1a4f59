"""Score any exported time series (a CSV from Prometheus, a spreadsheet...) with no tuning.

Each value column is judged against a trailing robust baseline (median and MAD of the previous
`window` rows) on its level and on its change, so a trend or a slow wave follows the baseline
while a jump, a spike or a flat-line break stands out. The row's score is its worst column's
robust z divided by the threshold: above 1 is an anomaly. `sensitivity` scales the threshold.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from detectors.moving import MAD_TO_SIGMA


class SeriesError(ValueError):
    """The input cannot be scored; the message says what to fix."""


def read_series(path: str, time_column: str, value_columns: list[str] | None) -> pd.DataFrame:
    """Load and validate a CSV: the time column exists, value columns are numeric."""
    try:
        df = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise SeriesError(f"{path}: the file is empty") from None
    except UnicodeDecodeError as err:
        raise SeriesError(f"{path}: not UTF-8 text (found byte {err.object[err.start]:#04x}); "
                          "save the CSV as UTF-8") from None
    except (OSError, pd.errors.ParserError) as err:
        raise SeriesError(f"{path}: cannot read CSV ({err})") from None
    if df.empty:
        raise SeriesError(f"{path}: no rows")
    if time_column not in df.columns:
        raise SeriesError(f"{path}: no column {time_column!r} (columns: {', '.join(df.columns)})")
    columns = value_columns or [c for c in df.columns if c != time_column]
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise SeriesError(f"{path}: no column(s) {', '.join(map(repr, missing))} "
                          f"(columns: {', '.join(df.columns)})")
    for c in columns:
        values = pd.to_numeric(df[c], errors="coerce")
        bad = values.isna() & df[c].notna()
        if bad.any():
            row = int(np.flatnonzero(bad.to_numpy())[0])
            raise SeriesError(f"{path}: column {c!r} has a non-numeric value {df[c].iloc[row]!r} "
                              f"at data row {row + 1}")
        df[c] = values
    if not columns:
        raise SeriesError(f"{path}: no value columns besides {time_column!r}")
    return df.sort_values(time_column, kind="stable").reset_index(drop=True)[[time_column, *columns]]


def _trailing_z(x: pd.Series, window: int) -> pd.Series:
    past = x.shift(1).rolling(window, min_periods=max(5, window // 4))
    center = past.median()
    mad = (x.shift(1) - center).abs().rolling(window, min_periods=max(5, window // 4)).median()
    scale = np.maximum(mad * MAD_TO_SIGMA, np.maximum(center.abs() * 0.01, 1e-12))
    return ((x - center) / scale).abs()


def score_frame(df: pd.DataFrame, time_column: str, *, sensitivity: float = 1.0,
                threshold: float = 6.0) -> pd.DataFrame:
    """Return `df` with `anomaly_score` (>1 = anomalous) and `is_anomaly` per row."""
    if sensitivity <= 0:
        raise SeriesError(f"sensitivity must be > 0, got {sensitivity}")
    values = df.drop(columns=[time_column])
    window = int(np.clip(len(df) // 10, 20, 200))
    z = pd.concat([pd.concat([_trailing_z(values[c], window),
                              _trailing_z(values[c].diff(), window)], axis=1).max(axis=1)
                   for c in values.columns], axis=1).max(axis=1).fillna(0.0)
    out = df.copy()
    out["anomaly_score"] = (z / (threshold / sensitivity)).round(4)
    out["is_anomaly"] = out["anomaly_score"] > 1.0
    return out
