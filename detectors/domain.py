"""Detectors that know what they look at: stragglers, expert balance, loss and memory health.

Each follows the estimator contract on its own input and can say who is to blame (`culprits`).
"""

from __future__ import annotations

from numbers import Integral, Real

import numpy as np
from scipy.stats import binom
from sklearn.utils._param_validation import Interval
from sklearn.utils.validation import check_is_fitted

from meshscope.collector.figures import balancedness
from meshscope.detectors.base import Detector, RingRows, WindowedDetector, as_matrix, percentile_by_column
from meshscope.detectors.modes import MIX_ALPHA, MIX_LEARN, MIX_ROWS, MIX_SHIFT, paces_and_modes


def _median_of_others(X: np.ndarray) -> np.ndarray:
    """Per row and rank: the median of the other ranks' values (with two ranks, the other's)."""
    n = X.shape[1]
    if n > 16:  # leaving one rank out barely moves the median of many: O(n) not O(n^2)
        return np.repeat(np.median(X, axis=1, keepdims=True), n, axis=1)
    return np.stack(
        [np.median(np.delete(X, r, axis=1), axis=1) if n > 1 else X[:, r] for r in range(n)], axis=1
    )


class Straggler(WindowedDetector):
    """X: compute seconds, one row per step, one column per rank.

    A rank straggles when its compute time exceeds `ratio` times both the median of the other
    ranks and its own best recent time: the first separates it from its peers, the second from a
    step that is slow for everyone. On a noisy host the line is raised to `noise_margin` times
    the largest such ratio the rank's recent normal steps showed (their `noise_quantile`th
    percentile): a burst of the host's own noise is not a fault, a step well above it is.
    """

    _parameter_constraints = {
        "ratio": [Interval(Real, 1, None, closed="neither")],
        "window": [Interval(Integral, 1, None, closed="left")],
        "noise_margin": [Interval(Real, 1, None, closed="left")],
        "noise_quantile": [Interval(Real, 0, 100, closed="both")],
    }

    def __init__(
        self, ratio: float = 1.5, window: int = 50, noise_margin: float = 1.15, noise_quantile: float = 98
    ) -> None:
        self.ratio = ratio
        self.window = window
        self.noise_margin = noise_margin
        self.noise_quantile = noise_quantile

    def _offset(self) -> float:
        return float(self.ratio)

    def fit(self, X, y=None):
        """Start the window from `X`; returns self."""
        self._check()
        X = as_matrix(X)
        self.window_ = RingRows(self.window, X.shape[1]).extend(X)
        self._learn()
        self.noise_ = RingRows(self.window, X.shape[1]).extend(_without_one_offs(self.ratios(X)))
        self._learn_noise()
        return self

    def partial_fit(self, X, y=None):
        """Slide the window over `X` (in place); returns self."""
        check_is_fitted(self)
        X = as_matrix(X)
        if X.shape[1] != self.window_.cols:  # another world: start again
            return self.fit(X)
        self.noise_.extend(self.ratios(X))  # against the baseline it was judged on
        self.window_.extend(X)
        self._learn()
        self.unlearnt_ += len(X)
        if self.unlearnt_ >= 10:  # the noise moves slowly: a percentile every 10 steps, not each
            self._learn_noise()
        return self

    def _learn(self) -> None:
        self.best_ = percentile_by_column(self.window_.by_column(), 10)  # each rank's own best recent time

    def _learn_noise(self) -> None:
        ceiling = percentile_by_column(self.noise_.by_column(), self.noise_quantile)
        self.lines_ = np.maximum(self.ratio, self.noise_margin * ceiling)  # per rank
        self.unlearnt_ = 0

    def ratios(self, X) -> np.ndarray:
        """Each rank's compute over its peers' (and over its own best)."""
        X = as_matrix(X)
        others = _median_of_others(X)
        return np.minimum(X / np.maximum(others, 1e-9), X / np.maximum(self.best_, 1e-9))

    def score_samples(self, X) -> np.ndarray:
        check_is_fitted(self)
        return -self.ratios(X).max(axis=1)

    def culprits(self, X) -> list[list[int]]:
        lines = np.maximum(self.ratio, self.lines_)  # `ratio` may have been raised since (set_params)
        return [list(np.flatnonzero(row > lines)) for row in self.ratios(X)]

    def line(self, ranks: list[int]) -> float:
        """The ratio above which the lowest-lined of `ranks` straggles."""
        return float(np.maximum(self.ratio, self.lines_)[ranks].min())


SPAN_Q = 25
"""A horizon is judged on its lower quartile, not its median: a straggler is slow on every
step, while a worker that alternates between a usual and a slower mode (or a shared host's
bursts) is slow on some; their lower quartile stays at the usual pace."""


def span_quartile(rows: np.ndarray) -> np.ndarray:
    """Per column of `rows` (a horizon: a few rows of thousands of ranks, judged every step):
    their `SPAN_Q` percentile, by a sort of each column (`base.percentile_by_column`)."""
    return percentile_by_column(np.ascontiguousarray(np.asarray(rows, dtype=float).T), SPAN_Q)


def span_stats(dev: np.ndarray, span: int) -> np.ndarray:
    """Row i: the `SPAN_Q` percentile of rows i - span + 1 .. i (fewer at the start)."""
    head = [span_quartile(dev[: i + 1]) for i in range(min(span - 1, len(dev)))]
    if len(dev) < span:
        return np.asarray(head).reshape(len(dev), -1)
    # each window sorted once (np.percentile's selection along the windows' strided axis is
    # several times slower at thousands of ranks)
    ordered = np.sort(np.lib.stride_tricks.sliding_window_view(dev, span, axis=0), axis=-1)
    pos = SPAN_Q / 100 * (span - 1)
    lo, hi = int(pos), min(int(pos) + 1, span - 1)
    full = ordered[..., lo] + (ordered[..., hi] - ordered[..., lo]) * (pos - lo)
    return np.vstack([*head, full]) if head else full


def robust_noise(strays: np.ndarray) -> np.ndarray:
    """Per column: the spread of `strays` (rows of excess over the usual) as a robust standard
    deviation (1.4826 x the median absolute deviation), at least 1e-3."""
    spread = np.abs(strays - np.median(strays, axis=0))
    return np.maximum(1.4826 * np.median(spread, axis=0), 1e-3)


ONE_OFFS = 2
"""A warm-up's first steps pay one-off costs (lazy imports, first allocations, a first
collective's set-up): up to `ONE_OFFS` of a rank's largest warm-up ratios are taken at its next
largest, so two such steps of 20 do not set its noise line for the next 50 (a noisy rank shows
its noise again, and the line is relearnt every 10 steps)."""


def _without_one_offs(ratios: np.ndarray) -> np.ndarray:
    """Warm-up ratios (rows x ranks) with each rank's `ONE_OFFS` largest clipped (see `ONE_OFFS`)."""
    if len(ratios) <= 5 * ONE_OFFS:  # too few rows to tell a one-off from the noise
        return ratios
    return np.minimum(ratios, np.sort(ratios, axis=0)[-ONE_OFFS - 1])


class PersistentStraggler(WindowedDetector):
    """X: compute seconds, one row per step, one column per rank, in step order.

    The straggler too subtle for `Straggler`: a rank persistently 1.1-1.5x slower than it
    usually is relative to its peers. Each rank's usual pace relative to the step's median is
    learnt (some workers are always a little slower: heterogeneity, not an anomaly), with its
    step-to-step noise. Row i is scored on the median of the last `span` rows of X up to i, so
    the caller passes the recent rows and reads the last score; a rank straggles when that
    median exceeds its usual pace by more than `min_excess`, `z` times the noise of such
    medians, and `margin` times the largest such median the normal past showed (noise on a
    shared host comes in bursts). Several ranks can straggle at once, up to half.
    """

    _parameter_constraints = {
        "min_excess": [Interval(Real, 0, None, closed="neither")],
        "z": [Interval(Real, 0, None, closed="neither")],
        "margin": [Interval(Real, 0, None, closed="left")],
        "span": [Interval(Integral, 1, None, closed="left")],
        "min_history": [Interval(Integral, 1, None, closed="left")],
        "relearn_every": [Interval(Integral, 1, None, closed="left")],
        "window": [Interval(Integral, 2, None, closed="left")],
    }

    def __init__(
        self,
        min_excess: float = 0.08,
        z: float = 4.0,
        margin: float = 1.5,
        span: int = 5,
        min_history: int = 50,
        relearn_every: int = 10,
        window: int = 100,
    ) -> None:
        self.min_excess = min_excess
        self.z = z
        self.margin = margin
        self.span = span
        self.min_history = min_history
        self.relearn_every = relearn_every
        self.window = window

    def _offset(self) -> float:
        return 1.0

    def fit(self, X, y=None):
        """Learn from the normal rows `X` (the last `window` of them); returns self."""
        self._check()
        X = as_matrix(X)[-self.window :]
        self.__dict__.pop("pace_", None)  # a new world: paces from the plain median first
        for _ in range(2):  # then once more against the pace-normalised level they give
            self.__dict__.pop("slow_share_", None)  # learnt afresh, not moved a little
            self.rel_ = RingRows(self.window, X.shape[1]).extend(self.relative(X))
            self._learn_pace()
        return self

    def partial_fit(self, X, y=None):
        """Slide the window. Each new row's horizon statistic can only raise `worst_` at once;
        pace, modes and noise move slowly and are relearnt every `relearn_every` rows (at
        1,024 ranks a full relearn costs more than judging)."""
        check_is_fitted(self)
        X = as_matrix(X)
        if X.shape[1] != self.rel_.cols:  # another world: start again
            return self.fit(X)
        for rel in self.relative(X):
            self.rel_.extend(rel[None])
            self.worst_ = np.maximum(self.worst_, self.latest_excess(self.rel_.last(self.span).T))
            self.unlearnt_ += 1
        if self.unlearnt_ >= self.relearn_every or len(self.rel_) == self.min_history:
            self._learn_pace()
        return self

    def relative(self, X) -> np.ndarray:
        """Each rank's compute over the job's level, row by row: the median of the other ranks'
        compute, each divided by its usual pace first. A job that always ran at two paces then
        has one level, and the median does not jump between the groups when one rank changes
        (before paces are learnt: the plain median of the others)."""
        X = as_matrix(X)
        pace = getattr(self, "pace_", None)
        if pace is None or len(pace) != X.shape[1]:
            return X / np.maximum(_median_of_others(X), 1e-12)
        return X / np.maximum(_median_of_others(X / np.maximum(pace, 1e-12)), 1e-12)

    def _learn_pace(self) -> None:
        rows = self.rel_.last(len(self.rel_)).T  # oldest first: horizons need the order
        # each rank's usual pace against its peers, and its known slower mode if it has one
        self.pace_, self.upper_, self.mode_width_, share = paces_and_modes(rows)
        # the usual mix, from the rows before the latest horizon (the first steps of a changed
        # mix are normal rows until the horizon has seen enough of them), and learnt slowly
        # (`MIX_LEARN` a relearn): a changed mix must not become the usual before it is told
        older = rows[: max(len(rows) - MIX_ROWS, len(rows) // 2)] / np.maximum(self.pace_, 1e-12)
        in_slow = (older >= self.upper_ * (1 - self.mode_width_)).mean(axis=0)
        now = np.where(np.isfinite(share), in_slow, np.nan)
        before = getattr(self, "slow_share_", None)
        if before is not None and len(before) == len(now):
            now = np.where(np.isfinite(before), before + MIX_LEARN * (now - before), now)
        self.slow_share_ = now
        spans = span_stats(self._paced(rows), self.span) - 1
        self.noise_ = robust_noise(spans)
        self.worst_ = spans.max(axis=0)  # the largest horizon statistic the normal past showed
        self.unlearnt_ = 0

    def _paced(self, relative: np.ndarray) -> np.ndarray:
        """Rows of relative compute over each rank's usual pace, a step in a rank's known
        slower mode taken against that mode (`paces_and_modes`): a step there is its usual."""
        paced = relative / np.maximum(self.pace_, 1e-12)
        upper = self.upper_
        if not np.isfinite(upper).any():  # no rank has two modes (the usual job): nothing to take
            return paced
        return np.where(paced >= upper * (1 - self.mode_width_), paced / upper, paced)

    def thresholds(self) -> np.ndarray:
        """Per rank: the excess over its usual pace that counts."""
        check_is_fitted(self)
        if len(self.rel_) < self.min_history:  # too little normal past to tell its noise
            return np.full_like(self.noise_, np.inf)
        return np.maximum.reduce(
            [np.full_like(self.noise_, self.min_excess), self.z * self.noise_, self.margin * self.worst_]
        )

    def excess(self, X) -> np.ndarray:
        """Per row and rank: the horizon's pace over the usual (in its mode), minus 1."""
        check_is_fitted(self)
        return span_stats(self._paced(self.relative(X)), self.span) - 1

    def latest_excess(self, relative: np.ndarray) -> np.ndarray:
        """Per rank: `excess` of the last row only, given rows of `relative(X)` (the live rule
        computes each step's relative pace once and keeps the recent ones)."""
        check_is_fitted(self)
        return span_quartile(self._paced(relative[-self.span :])) - 1

    def two_modes(self) -> np.ndarray:
        """The ranks (column indices) with two known modes: the only ones whose mix can change."""
        check_is_fitted(self)
        return np.flatnonzero(np.isfinite(self.slow_share_))

    def mix_excess(self, relative: np.ndarray, ranks: np.ndarray, held: np.ndarray) -> np.ndarray:
        """Per rank of `ranks` (`two_modes`), given their columns of the last `MIX_ROWS` rows of
        `relative(X)`: whether its mix of modes changed (`MIX_SHIFT`, `MIX_ALPHA`), as its mean
        pace over those rows against its usual, minus 1; NaN where it did not. Each step in a
        known mode looks usual to `latest_excess`; a worker now mostly in its slower mode is
        not. `held`: per rank, already told; still changed while half the shift remains (a
        chance dip does not end it)."""
        if len(self.rel_) < self.window or len(relative) < MIX_ROWS:  # too few steps to tell a share
            return np.full(len(ranks), np.nan)
        rows = relative[-MIX_ROWS:] / np.maximum(self.pace_[ranks], 1e-12)
        slow = (rows >= self.upper_[ranks] * (1 - self.mode_width_[ranks])).sum(axis=0)
        # judged against the top of the usual share's own uncertainty (two standard errors)
        usual = self.slow_share_[ranks]
        usual = np.minimum(1.0, usual + 2 * np.sqrt(usual * (1 - usual) / (self.window - MIX_ROWS)))
        changed = (slow >= (usual + MIX_SHIFT) * MIX_ROWS) & (binom.sf(slow - 1, MIX_ROWS, usual) < MIX_ALPHA)
        changed |= held & (slow >= (usual + MIX_SHIFT / 2) * MIX_ROWS)
        return np.where(changed, rows.mean(axis=0) - 1, np.nan)

    def in_slower_mode(self, relative: np.ndarray, rank: int) -> np.ndarray:
        """Per row of `relative` (one rank's column): whether that step is in the rank's slower mode."""
        return relative / max(self.pace_[rank], 1e-12) >= self.upper_[rank] * (1 - self.mode_width_[rank])

    def score_samples(self, X) -> np.ndarray:
        return -(self.excess(X) / self.thresholds()).max(axis=1)

    def culprits(self, X) -> list[list[int]]:
        over = self.excess(X) / self.thresholds()
        return [list(np.flatnonzero(row > 1.0)) for row in over]


class ExpertBalance(WindowedDetector):
    """X: one layer's expert shares, one row per window, one column per expert.

    An expert hogs when its share exceeds `hog` times its usual share (learnt on warm-up) and
    starves below `starve` times it; the score is the worst such factor.
    """

    _parameter_constraints = {
        "hog": [Interval(Real, 1, None, closed="neither")],
        "starve": [Interval(Real, 0, 1, closed="neither")],
        "window": [Interval(Integral, 1, None, closed="left")],
    }

    def __init__(self, hog: float = 2.0, starve: float = 0.2, window: int = 6) -> None:
        self.hog = hog
        self.starve = starve
        self.window = window

    def _offset(self) -> float:
        return 1.0

    def _learn(self) -> None:
        self.usual_ = np.maximum(np.median(self.history_, axis=0), 1e-6)

    def factors(self, X) -> np.ndarray:
        """Per expert: how far outside its usual band (1 = at the edge), signed up for hogs."""
        rel = as_matrix(X) / self.usual_
        return np.maximum(rel / self.hog, self.starve / np.maximum(rel, 1e-9))

    def score_samples(self, X) -> np.ndarray:
        check_is_fitted(self)
        return -self.factors(X).max(axis=1)

    def culprits(self, X) -> list[list[int]]:
        return [list(np.flatnonzero(row > 1.0)) for row in self.factors(X)]


class ExpertLoad(WindowedDetector):
    """X: one layer's expert shares, one row per window, one column per expert (rows sum to 1).

    Judged in units that mean the same for any number of experts E and top-k: the balanced
    share 1/E and the most top-k routing allows, 1/k. Per expert, hotness
    h = (share - 1/E) / (1/k - 1/E) runs from 0 (balanced) to 1 (every token routed to it);
    starvation u = 1 - share * E from 0 (its fair share) to 1 (no tokens). An expert hogs when
    h >= max(`hog_min`, its usual h + `margin`) and starves when u >= max(`starve_min`, its usual
    u + `margin`): only a move away from balance, beyond what the layer usually does, counts.
    Scores are bounded in [0, 1] (the h or u that flagged); balancedness = mean / max load, as
    serving engines report it.
    """

    def __init__(
        self,
        top_k: int = 1,
        hog_min: float = 0.5,
        starve_min: float = 0.9,
        margin: float = 0.25,
        window: int = 6,
    ) -> None:
        self.top_k = top_k
        self.hog_min = hog_min
        self.starve_min = starve_min
        self.margin = margin
        self.window = window

    _parameter_constraints = {
        "top_k": [Interval(Integral, 1, None, closed="left")],
        "hog_min": [Interval(Real, 0, 1, closed="both")],
        "starve_min": [Interval(Real, 0, 1, closed="both")],
        "margin": [Interval(Real, 0, 1, closed="both")],
        "window": [Interval(Integral, 1, None, closed="left")],
    }

    def _offset(self) -> float:
        return 0.0

    def _learn(self) -> None:
        self.usual_ = np.median(self.history_, axis=0)

    def hotness(self, X) -> np.ndarray:
        """Per expert: 0 at its fair share, 1 when it takes every token (top-k aware)."""
        X = as_matrix(X)
        experts = X.shape[1]
        top = 1.0 / max(1, min(self.top_k, experts))
        fair = 1.0 / experts
        return (X - fair) / max(top - fair, 1e-9)

    def starvation(self, X) -> np.ndarray:
        """Per expert: 0 at its fair share, 1 when it gets nothing."""
        X = as_matrix(X)
        return 1.0 - X * X.shape[1]

    @staticmethod
    def balancedness(X) -> np.ndarray:
        """mean / max load per row (`figures.balancedness`): 1 balanced, 1/E all on one expert."""
        return np.atleast_1d(balancedness(as_matrix(X)))

    def severities(self, X) -> tuple[np.ndarray, np.ndarray]:
        """Per expert, bounded: (hog severity, starvation severity), 0 where not anomalous."""
        hot, usual_hot = self.hotness(X), self.hotness(self.usual_.reshape(1, -1))
        starve, usual_starve = self.starvation(X), self.starvation(self.usual_.reshape(1, -1))
        hog = np.where(hot >= np.maximum(self.hog_min, usual_hot + self.margin), np.clip(hot, 0, 1), 0.0)
        low = np.where(
            starve >= np.maximum(self.starve_min, usual_starve + self.margin), np.clip(starve, 0, 1), 0.0
        )
        return hog, low

    def factors(self, X) -> np.ndarray:
        """Per expert: the larger of its hog and starvation severities."""
        hog, low = self.severities(X)
        return np.maximum(hog, low)

    def score_samples(self, X) -> np.ndarray:
        check_is_fitted(self)
        return -self.factors(X).max(axis=1)

    def culprits(self, X) -> list[list[int]]:
        return [list(np.flatnonzero(row > 0.0)) for row in self.factors(X)]


class NonFinite(Detector):
    """X: loss per rank. Any NaN/Inf is an anomaly; nothing to learn."""

    def _offset(self) -> float:
        return 0.5

    def fit(self, X, y=None) -> NonFinite:
        """Nothing to learn: NaN and Inf need no baseline."""
        self.n_features_ = as_matrix(X).shape[1]
        return self

    def score_samples(self, X) -> np.ndarray:
        check_is_fitted(self)
        return -(~np.isfinite(as_matrix(X))).any(axis=1).astype(float)

    def culprits(self, X) -> list[list[int]]:
        return [list(np.flatnonzero(~np.isfinite(row))) for row in as_matrix(X)]


class MemoryGrowth(WindowedDetector):
    """X: resident memory per rank, one row per step. Growth faster than `mb_per_step` over the
    last `window` steps, on any rank, is a leak."""

    _parameter_constraints = {
        "mb_per_step": [Interval(Real, 0, None, closed="neither")],
        "window": [Interval(Integral, 2, None, closed="left")],
    }

    def __init__(self, mb_per_step: float = 2.0, window: int = 5) -> None:
        self.mb_per_step = mb_per_step
        self.window = window

    def _offset(self) -> float:
        return 1.0

    def slopes(self, X) -> np.ndarray:
        """MB per step against the oldest remembered row, per rank."""
        X = as_matrix(X)
        base = self.history_[0]
        steps = len(self.history_)
        return (X - base) / (1 << 20) / max(steps, 1) / self.mb_per_step

    def score_samples(self, X) -> np.ndarray:
        check_is_fitted(self)
        return -self.slopes(X).max(axis=1)

    def culprits(self, X) -> list[list[int]]:
        return [list(np.flatnonzero(row > 1.0)) for row in self.slopes(X)]
