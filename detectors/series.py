"""Score any exported time series (a CSV from Prometheus, W&B, a spreadsheet...) with no tuning.

Online: each row is judged from the rows before it only. Per value column:

1. **Predict** the row two ways: the level (median of the last few rows, so a spike does not
   move it and a level shift is followed within a few rows) and, once the past shows a season
   (autocorrelation peak), the same phase of the previous cycles corrected for the current level
   (within one row of phase, so a period that is not a whole number of rows does not misfire).
   The predictor whose recent residuals are smaller is used.
2. **Scale** the residual by the past residuals: the largest normal-equivalent scale read off
   their 50th, 90th, 99th and 99.5th percentiles, so mostly-zero residuals (a square wave, a
   quantised counter) and heavy tails are both covered, with a floor relative to the series'
   own range and level, so a series that sits still does not divide by zero. A row judged
   anomalous adds its residual clipped to the size that flags: the scale learns the noise, not
   the anomalies (a larger anomaly after a smaller one is still news).
3. **Score** with a tail probability, 1 - P(|residual| this large), in [0, 1]; with several
   columns the row takes the most surprising one, Bonferroni-corrected. `anomaly_score` ranks
   rows as news: that score, halved on the rows of an episode after its onset. Those rows are
   the episode's own, already said by its onset, so any threshold that keeps the onset keeps
   one row of it, not every row until the scale has learnt the new level.
4. **Flag onsets**: `is_anomaly` marks the first row of an anomalous episode; `in_episode`
   stays true until the series has been unsurprising for `quiet_rows` rows, so a level shift
   or a burst of spikes gives one flag, not one per row.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque

import numpy as np
import pandas as pd

from meshscope.detectors.thresholds import SeriesConfig, SeriesError

TIME_COLUMNS = ("time", "timestamp", "ts", "date", "datetime")  # what exports call it


def read_series(path: str, time_column: str | None, value_columns: list[str] | None) -> pd.DataFrame:
    """Load and validate a CSV: the time column exists (None: the first column named like one
    of TIME_COLUMNS), value columns are numeric. The time column comes first in the result."""
    try:
        df = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise SeriesError(f"{path}: the file is empty") from None
    except UnicodeDecodeError as err:
        raise SeriesError(
            f"{path}: not UTF-8 text (found byte {err.object[err.start]:#04x}); save the CSV as UTF-8"
        ) from None
    except (OSError, pd.errors.ParserError) as err:
        raise SeriesError(f"{path}: cannot read CSV ({err})") from None
    if df.empty:
        raise SeriesError(f"{path}: no rows")
    if time_column is None:
        named = [c for c in df.columns if str(c).strip().lower() in TIME_COLUMNS]
        if not named:
            raise SeriesError(
                f"{path}: no time column (looked for {', '.join(TIME_COLUMNS)}); "
                f"name it with --time-column (columns: {', '.join(map(str, df.columns))})"
            )
        time_column = named[0]
    if time_column not in df.columns:
        raise SeriesError(f"{path}: no column {time_column!r} (columns: {', '.join(df.columns)})")
    columns = value_columns or [c for c in df.columns if c != time_column]
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise SeriesError(
            f"{path}: no column(s) {', '.join(map(repr, missing))} (columns: {', '.join(df.columns)})"
        )
    for c in columns:
        values = pd.to_numeric(df[c], errors="coerce")
        bad = values.isna() & df[c].notna()
        if bad.any():
            row = int(np.flatnonzero(bad.to_numpy())[0])
            raise SeriesError(
                f"{path}: column {c!r} has a non-numeric value {df[c].iloc[row]!r} at data row {row + 1}"
            )
        df[c] = values
    if not columns:
        raise SeriesError(f"{path}: no value columns besides {time_column!r}")
    return df[[time_column, *columns]]


# the two-sided normal quantile of each percentile used for the scale
_SCALE_QUANTILES = ((0.5, 0.6745), (0.9, 1.6449), (0.99, 2.5758), (0.995, 2.8070))


def estimate_period(past: np.ndarray, max_period: int, min_autocorrelation: float) -> int | None:
    """The season of `past` in rows (the strongest autocorrelation peak), or None."""
    x = past[np.isfinite(past)]
    n = len(x)
    if n < 12:
        return None
    x = x - np.median(x)
    peak = float(np.abs(x).max())
    if not 0 < peak < math.inf:
        return None
    x = x / peak  # no overflow on values near the float limits
    x = x - x.mean()
    power = float(np.dot(x, x))
    if not power > 0:
        return None
    size = 1 << int(math.ceil(math.log2(2 * n)))
    spectrum = np.fft.rfft(x, size)
    acf = np.fft.irfft(spectrum * np.conj(spectrum), size)[:n] / power
    acf *= n / np.maximum(n - np.arange(n), 1)  # unbiased: long lags see fewer pairs
    top = min(max_period, n // 2)  # two cycles at least
    if top < 4:
        return None
    lags = np.arange(2, top)
    peaks = lags[(acf[lags] > acf[lags - 1]) & (acf[lags] >= acf[lags + 1])]
    peaks = peaks[acf[peaks] >= min_autocorrelation]
    # A season has a trough before its peak; a trend or a step only decays slowly.
    peaks = np.array([p for p in peaks if acf[p] - acf[1:p].min() >= 0.3], int)
    if len(peaks) == 0:
        return None
    # The first strong peak is the season; its multiples are as strong on a clean series.
    best = float(acf[peaks].max())
    return int(peaks[acf[peaks] >= best - 0.1][0])


class _SortedWindow:
    """The last `size` values, kept sorted too, so quantiles cost an index, not a sort."""

    def __init__(self, size: int) -> None:
        self.order: deque[float] = deque()
        self.sorted: list[float] = []
        self.size = size

    def add(self, value: float) -> None:
        if not math.isfinite(value):
            return  # an overflowed residual says nothing about the scale
        self.order.append(value)
        bisect.insort(self.sorted, value)
        if len(self.order) > self.size:
            del self.sorted[bisect.bisect_left(self.sorted, self.order.popleft())]

    def quantile(self, q: float) -> float:
        return self.sorted[int(q * (len(self.sorted) - 1))]

    def __len__(self) -> int:
        return len(self.sorted)


class _Residuals:
    """One predictor's recent absolute residuals, and the tail probability they imply."""

    def __init__(self, rows: int, flag_z: float, quiet: float) -> None:
        self.window = _SortedWindow(rows)  # clipped where anomalous: the scale and its tails
        self.seen = _SortedWindow(rows)  # as they were: what the recent past has shown
        self.flag_z = flag_z
        self.quiet = quiet  # the tail of a row that is not news

    def ready(self) -> bool:
        return len(self.window) >= _MIN_RESIDUALS

    def scale(self) -> float:
        """The largest normal-equivalent scale read off the residuals' percentiles."""
        if not self.ready():
            return math.inf
        return max(self.window.quantile(q) / z for q, z in _SCALE_QUANTILES)

    def learn(self, residual: float, anomalous: bool) -> None:
        """Remember a residual for the scale. One the row was judged anomalous for enters only
        up to the size that would flag it: an episode must not teach the scale that episodes
        are normal (the next, larger anomaly would pass), yet a lasting rise in the noise
        still widens the scale through the rows below that size."""
        r = abs(residual)
        self.seen.add(r)
        self.window.add(min(r, self.scale() * self.flag_z) if anomalous and self.ready() else r)

    def tail(self, residual: float, floor: float) -> float:
        """P(|residual| at least this large): a normal tail, or an exponential one fitted to
        the 90th..99th percentiles where the past has heavier tails than a normal's."""
        r = abs(residual)
        if math.isnan(r):
            return 1.0
        seen = len(self.seen) - bisect.bisect_left(self.seen.sorted, r)
        if seen >= 2:  # the recent past showed this twice: not news (a square wave, a cron job)
            return max(seen / (len(self.seen) + 1), self.quiet)
        scale = max(self.scale(), floor)
        normal = math.erfc(r / scale / math.sqrt(2))
        # Exponential tails through the 90th..99th and the 99th..99.5th percentiles: the
        # heavier one wins, so a heavy-tailed past is not a string of false alarms.
        q90, q99, q995 = (self.window.quantile(q) for q in (0.9, 0.99, 0.995))
        fitted = [normal]
        for (q_lo, p_lo), (q_hi, p_hi) in (((q90, 0.1), (q99, 0.01)), ((q99, 0.01), (q995, 0.005))):
            beta = (q_hi - q_lo) / math.log(p_lo / p_hi)
            if beta > floor and r > q_hi:
                fitted.append(p_hi * math.exp(-(r - q_hi) / beta))
        return max(fitted)


_MIN_RESIDUALS = 50


class ColumnDetector:
    """Judges one series online, a row at a time: `update(x)` returns the row's tail probability."""

    def __init__(self, config: SeriesConfig) -> None:
        self.config = config
        self.history: list[float] = []
        self.values = _SortedWindow(config.scale_rows)
        self.period: int | None = None
        # the residual that flags a row on its own: each of the three tests gets alpha / 3
        flag_z = statistics.NormalDist().inv_cdf(1 - config.alpha / 6)
        self.level, self.seasonal, self.shift = (
            _Residuals(config.scale_rows, flag_z, config.exit_alpha) for _ in range(3)
        )
        self._next_period_check = config.min_rows
        self._repeats = 0  # past rows equal to the row before them
        self._run = 0  # rows in a row equal to the one before, up to now
        self._longest_run = 0  # the longest such run that has ended

    def update(self, x: float) -> float:
        """The tail probability of `x` given the rows before it (1.0 while warming up or missing)."""
        c, past = self.config, self.history
        if not math.isfinite(x):
            return 1.0  # a missing value is not evidence of anything
        tail = 1.0
        if len(past) >= c.min_rows:
            self._refresh_period()
            floor = self._floor()
            r_level = x - _median(past[-c.level_rows :])
            r_season = self._seasonal_residual(x)
            model, residual = self.level, r_level
            if r_season is not None and self.seasonal.ready() and self.seasonal.scale() < self.level.scale():
                model, residual = self.seasonal, r_season
            r_shift = self._shift_residual(x)
            tails = [self._stuck_tail(x)]
            if model.ready():
                tails.append(model.tail(residual, floor))
            if r_shift is not None and self.shift.ready():
                tails.append(self.shift.tail(r_shift, floor / math.sqrt(c.shift_rows)))
            tail = min(1.0, 3 * min(tails))  # three tests: Bonferroni
            anomalous = tail < c.alpha
            self.level.learn(r_level, anomalous)
            if r_shift is not None:
                self.shift.learn(r_shift, anomalous)
            if r_season is not None:
                self.seasonal.learn(r_season, anomalous)
        self._count_repeat(x)
        past.append(x)
        self.values.add(x)
        return tail

    def _shift_residual(self, x: float) -> float | None:
        """The mean of the last `shift_rows` rows against the median of the `reference_rows`
        before them: a level shift or a new trend too small for any single row to show."""
        w, ref_rows, past = self.config.shift_rows, self.config.reference_rows, self.history
        if len(past) < w - 1 + ref_rows:
            return None
        recent = (sum(past[len(past) - w + 1 :]) + x) / w
        return recent - _median(past[len(past) - w + 1 - ref_rows : len(past) - w + 1])

    def _stuck_tail(self, x: float) -> float:
        """P(a run of repeated values this long), for a series that seldom repeats itself (a
        sensor stuck on one value); runs no longer than the past has shown are not news."""
        if not self.history or x != self.history[-1]:
            return 1.0
        p_repeat = (self._repeats + 1) / (len(self.history) + 1)
        run = self._run + 1
        if p_repeat >= 0.5 or run <= self._longest_run:
            return 1.0
        return p_repeat ** (run - self._longest_run)

    def _count_repeat(self, x: float) -> None:
        if self.history and x == self.history[-1]:
            self._repeats += 1
            self._run += 1
        else:
            self._longest_run = max(self._longest_run, self._run)
            self._run = 0

    def _refresh_period(self) -> None:
        n = len(self.history)
        if n < self._next_period_check:
            return
        # Often while young (a season needs two cycles to show), then every `period_every`.
        self._next_period_check = n + min(self.config.period_every, max(10, n // 4))
        recent = np.asarray(self.history[-4 * self.config.max_period :], float)
        period = estimate_period(recent, self.config.max_period, self.config.min_autocorrelation)
        if period is None or self.period is None or abs(period - self.period) > 1:
            self.period = period  # within a row of the old one: the phase tolerance covers it

    def _seasonal_residual(self, x: float) -> float | None:
        """The residual against the same phase of the last three cycles, each corrected for
        the level now, within a row of phase; their median, so one odd cycle does not make the
        next normal one look odd and a season of a fractional number of rows still fits."""
        p, past, k = self.period, self.history, self.config.level_rows
        if p is None or len(past) < p + 1 + k:
            return None
        level_now = _median(past[-k:])
        predictions = [
            past[-lag] + level_now - _median(past[-lag - k : -lag])
            for cycle in range(1, 4)
            for lag in (cycle * p - 1, cycle * p, cycle * p + 1)
            if lag + k <= len(past)
        ]
        return x - _median(predictions)

    def _floor(self) -> float:
        spread = self.values.sorted[-1] - self.values.sorted[0]
        level = abs(self.values.quantile(0.5))
        return max(self.config.relative_floor * max(spread, level), 1e-12)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def score_frame(
    df: pd.DataFrame, time_column: str, *, sensitivity: float = 1.0, config: SeriesConfig | None = None
) -> pd.DataFrame:
    """Return `df` with `anomaly_score` (1 - tail probability, in [0, 1]; halved after an
    episode's onset, module doc), `is_anomaly` (the onset of an anomalous episode) and
    `in_episode` per row. Online: rows are judged in time
    order, each from the rows before it only; the result keeps `df`'s own row order."""
    config = config or SeriesConfig.with_sensitivity(sensitivity)
    columns = [c for c in df.columns if c != time_column]
    detectors = [ColumnDetector(config) for _ in columns]
    order = np.argsort(df[time_column].to_numpy(), kind="stable")
    values = df[columns].to_numpy(float)[order]
    tails = np.ones(len(df))
    for i, row in enumerate(values):
        worst = min(d.update(float(v)) for d, v in zip(detectors, row, strict=True))
        tails[i] = min(1.0, worst * len(columns))
    onset, episode = flag_episodes(tails, config)
    news = np.where(episode & ~onset, (1.0 - tails) / 2, 1.0 - tails)
    out = df.copy()
    for name, by_time in (("anomaly_score", news), ("is_anomaly", onset), ("in_episode", episode)):
        column = np.empty_like(by_time)
        column[order] = by_time  # back to the input's rows
        out[name] = column
    return out


def flag_episodes(tails: np.ndarray, config: SeriesConfig) -> tuple[np.ndarray, np.ndarray]:
    """Onset flags and episode membership from per-row tail probabilities (hysteresis). A row
    below `alpha` opens an episode. So do two rows in a row below `pair_alpha` (a lasting change
    shows twice, a stray draw seldom does), except while the scale still learns the level an
    episode left behind: for `scale_rows` rows after an onset."""
    onset = np.zeros(len(tails), bool)
    episode = np.zeros(len(tails), bool)
    inside, quiet, pending, settled_at = False, 0, False, 0
    for i, tail in enumerate(tails):
        paired = pending and tail < config.pair_alpha and i >= settled_at
        if not inside and (tail < config.alpha or paired):
            inside, quiet, onset[i], settled_at = True, 0, True, i + config.scale_rows
        elif inside:
            quiet = quiet + 1 if tail >= config.exit_alpha else 0
            if quiet >= config.quiet_rows:
                inside = False
        pending = tail < config.pair_alpha
        episode[i] = inside
    return onset, episode
