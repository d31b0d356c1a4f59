"""Moving-average detectors: EWMA z-scores and robust (median/MAD) z-scores per series.

Both learn a baseline on a warm-up window and score each row by its worst column; `partial_fit`
moves the baseline on with normal data, so a slow wave (seasonality, a falling loss) is followed,
not flagged, while a jump is.
"""

from __future__ import annotations

from numbers import Integral, Real

import numpy as np
from sklearn.utils._param_validation import Interval
from sklearn.utils.validation import check_is_fitted

from meshscope.detectors.base import Detector, WindowedDetector, as_matrix

MAD_TO_SIGMA = 1.4826


class RobustZ(WindowedDetector):
    """|x - median| / (1.4826 MAD) over a rolling window of normal rows; anomaly above `threshold`."""

    _parameter_constraints = {
        "threshold": [Interval(Real, 0, None, closed="neither")],
        "window": [Interval(Integral, 1, None, closed="left")],
        "min_scale": [Interval(Real, 0, None, closed="neither")],
    }

    def __init__(self, threshold: float = 6.0, window: int = 200, min_scale: float = 1e-9) -> None:
        self.threshold = threshold
        self.window = window
        self.min_scale = min_scale

    def _learn(self) -> None:
        # np.nanmedian goes through masked arrays for small inputs (~0.25 ms a call, every step)
        median = np.nanmedian if np.isnan(self.history_).any() else np.median
        self.center_ = median(self.history_, axis=0)
        mad = median(np.abs(self.history_ - self.center_), axis=0) * MAD_TO_SIGMA
        # a flat warm-up (MAD 0) must not make every wiggle infinite: floor by 1 % of the level
        self.scale_ = np.maximum(mad, np.maximum(np.abs(self.center_) * 0.01, self.min_scale))

    def zscores(self, X) -> np.ndarray:
        """(X - median) / scaled MAD, per column."""
        return (as_matrix(X) - self.center_) / self.scale_

    def score_samples(self, X) -> np.ndarray:
        check_is_fitted(self)
        z = np.abs(self.zscores(X))
        return -np.nan_to_num(z, nan=np.inf).max(axis=1)


class EWMA(Detector):
    """Exponentially weighted mean and variance; z = (x - mean) / std, anomaly above `threshold`."""

    _parameter_constraints = {
        "alpha": [Interval(Real, 0, 1, closed="right")],
        "threshold": [Interval(Real, 0, None, closed="neither")],
        "min_std": [Interval(Real, 0, None, closed="neither")],
    }

    def __init__(self, alpha: float = 0.05, threshold: float = 6.0, min_std: float = 1e-9) -> None:
        self.alpha = alpha
        self.threshold = threshold
        self.min_std = min_std

    def fit(self, X, y=None) -> EWMA:
        """Start the moving mean and variance from `X`; returns self."""
        self._check()
        X = as_matrix(X)
        self.mean_ = np.nanmean(X, axis=0)
        self.var_ = np.nanvar(X, axis=0)
        return self.partial_fit(X)

    def partial_fit(self, X, y=None) -> EWMA:
        """Move the mean and variance over `X`; returns self."""
        for row in as_matrix(X):
            ok = np.isfinite(row)
            diff = np.where(ok, row - self.mean_, 0.0)
            self.mean_ = self.mean_ + self.alpha * diff
            self.var_ = (1 - self.alpha) * (self.var_ + self.alpha * diff**2)
        return self

    def score_samples(self, X) -> np.ndarray:
        check_is_fitted(self)
        std = np.maximum(np.sqrt(self.var_), np.maximum(np.abs(self.mean_) * 0.01, self.min_std))
        z = np.abs((as_matrix(X) - self.mean_) / std)
        return -np.nan_to_num(z, nan=np.inf).max(axis=1)
