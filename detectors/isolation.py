"""Online IsolationForest over step features, with the reasons for each score.

Fitted on a warm-up window of robustly scaled features, refitted on a schedule on recent rows it
judged normal, so drift is learnt and anomalies are not. `explain(X)` names the features that
drove each score (largest robust deviations from the training data).
"""
from __future__ import annotations

import numpy as np
from sklearn.ensemble import IsolationForest

from detectors.base import Detector, as_matrix


class OnlineIsolationForest(Detector):
    def __init__(self, n_estimators: int = 100, window: int = 400, refit_every: int = 100,
                 threshold: float = 0.8, random_state: int = 0) -> None:
        self.n_estimators = n_estimators
        self.window = window
        self.refit_every = refit_every
        self.threshold = threshold
        self.random_state = random_state

    def fit(self, X, y=None) -> "OnlineIsolationForest":
        X = np.nan_to_num(as_matrix(X))[-self.window:]
        self.center_ = np.median(X, axis=0)
        iqr = np.subtract(*np.percentile(X, [75, 25], axis=0))
        self.scale_ = np.maximum(iqr, np.maximum(np.abs(self.center_) * 0.01, 1e-9))
        self.forest_ = IsolationForest(n_estimators=self.n_estimators,
                                       random_state=self.random_state).fit(self._scaled(X))
        self.buffer_ = X
        self.since_fit_ = 0
        return self

    def _scaled(self, X: np.ndarray) -> np.ndarray:
        return np.clip((X - self.center_) / self.scale_, -1e6, 1e6)

    def score_samples(self, X) -> np.ndarray:
        """IsolationForest's score (about -0.5 for normal rows, toward -1 for anomalies;
        anomalous below -threshold), lowered for rows beyond the range the trees were grown on.

        Trees cannot isolate a value past every split any faster than the most extreme training
        value, so a step 100 IQRs out scores like an ordinary edge point. The penalty restores
        the ordering: 0.1 per IQR beyond 8 IQRs from the median, on the worst feature."""
        scaled = self._scaled(np.nan_to_num(as_matrix(X)))
        beyond = np.maximum(np.abs(scaled).max(axis=1) - 8.0, 0.0)
        return self.forest_.score_samples(scaled) - 0.1 * beyond

    def partial_fit(self, X, y=None) -> "OnlineIsolationForest":
        """Add rows judged normal; refit every `refit_every` rows on the last `window`."""
        self.buffer_ = np.vstack([self.buffer_, np.nan_to_num(as_matrix(X))])[-self.window:]
        self.since_fit_ += len(as_matrix(X))
        if self.since_fit_ >= self.refit_every:
            self.fit(self.buffer_)
        return self

    def explain(self, X, names: list[str], top: int = 3) -> list[list[tuple[str, float]]]:
        dev = np.abs(self._scaled(np.nan_to_num(as_matrix(X))))
        return [[(names[i], round(float(row[i]), 2)) for i in np.argsort(-row)[:top]]
                for row in dev]
