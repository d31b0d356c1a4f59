"""The detection engine: StepRecords in, anomaly episodes out, beside training or afterwards.

It processes complete steps in order. The first `warmup` steps fit every detector; after that each
step is scored, flagged steps feed episodes, and normal ones move the baselines on. Each episode
becomes one `anomaly` event (detail: type, ranks, layer/expert, score, start_step, end_step,
evidence) when it closes, and counts in `meshscope_anomalies_total{type}` when it opens.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from detectors.domain import ExpertBalance, MemoryGrowth, NonFinite, Straggler
from detectors.episodes import Episode, EpisodeTracker
from detectors.features import COLUMN, StepFeaturizer, StepView, step_views
from detectors.isolation import OnlineIsolationForest
from detectors.moving import RobustZ

# Relative features only: levels (tokens/s, step time) drift with the run and the machine. Not
# the gradient norm either: 3-4x spikes for a step or two are ordinary in LM training (4 in a
# 15,000-step clean run here) and a spike that matters shows as a loss spike or a NaN.
MULTIVARIATE = ["step_spread", "compute_spread", "comm_ratio", "loss_delta", "mem_slope"]
# The smallest change per feature that can matter (the forest's scale floor): 5 % spread or
# comm ratio, 0.05 in loss, 1 MiB/step of memory. A feature that sat still in the window would
# otherwise turn the first wiggle into a million IQRs.
MULTIVARIATE_MIN_SCALE = (0.05, 0.05, 0.05, 0.05, float(1 << 20))


@dataclass
class _Row:
    """One step (or the stacked warm-up) as the detectors take it: 2-D arrays, a row per step."""

    feats: np.ndarray
    compute: np.ndarray
    loss: np.ndarray
    rss: np.ndarray
    ranks: list[int]

    def col(self, name: str) -> np.ndarray:
        return self.feats[:, [COLUMN[name]]]

    def value(self, name: str) -> float:
        return float(self.feats[0, COLUMN[name]])

    @property
    def multivariate(self) -> np.ndarray:
        return self.feats[:, [COLUMN[n] for n in MULTIVARIATE]]


@dataclass(kw_only=True)
class EngineConfig:
    """How the engine judges. `sensitivity` > 1 flags more, < 1 flags less."""

    warmup: int = 20
    gap: int = 3
    sensitivity: float = 1.0

    def __post_init__(self) -> None:
        if self.warmup < 5:
            raise ValueError(f"EngineConfig.warmup must be >= 5, got {self.warmup}")
        if self.sensitivity <= 0:
            raise ValueError(f"EngineConfig.sensitivity must be > 0, got {self.sensitivity}")


class DetectionEngine:
    def __init__(self, config: EngineConfig | None = None,
                 on_open: Callable[[Episode], None] = lambda ep: None,
                 on_close: Callable[[Episode], None] = lambda ep: None,
                 on_score: Callable[[str, float], None] = lambda name, score: None) -> None:
        self.config = config or EngineConfig()
        s = self.config.sensitivity
        self.straggler = Straggler(ratio=1 + 0.8 / s)
        self.comm = RobustZ(threshold=4.0 / s)
        self.comm_slowdown = 1 + 0.3 / s  # and the step this much slower than usual: it costs
        self.step_time = RobustZ(window=200)  # its centre: the usual step time (stall, comm)
        self.stall = 10.0 / s  # a step this many times the usual: a stuck collective
        self.loss = RobustZ(threshold=8.0 / s)
        self.memory = MemoryGrowth(mb_per_step=2.0 / s)
        self.nonfinite = NonFinite()
        self.forest = OnlineIsolationForest(min_scale=MULTIVARIATE_MIN_SCALE)
        self.experts: dict[int, ExpertBalance] = {}
        self.tracker = EpisodeTracker(gap=self.config.gap)
        self.on_open, self.on_close, self.on_score = on_open, on_close, on_score
        self.last_step = -1
        self.last_expert_step = -1
        self._fitted = False
        self.featurizer = StepFeaturizer()
        self._warm: list[_Row] = []
        self._ranks: list[int] = []
        self._warm_experts: dict[int, list[np.ndarray]] = {}
        self._expert_spacing = 1

    # --- feeding --------------------------------------------------------------------------
    def process(self, steps: pd.DataFrame, expert_load: pd.DataFrame | None = None) -> None:
        """Judge the steps after the last one seen (only steps every rank has recorded)."""
        for view in step_views(steps, after=self.last_step):
            self._step(view)
            self.last_step = view.step
        if expert_load is not None and not expert_load.empty:
            self._experts(expert_load[expert_load["step"] > self.last_expert_step])

    def finish(self) -> list[Episode]:
        """Close every open episode (end of the run)."""
        done = self.tracker.close_all()
        for ep in done:
            self.on_close(ep)
        return done

    # --- one step -------------------------------------------------------------------------
    def _step(self, view: StepView) -> None:
        row = _Row(self.featurizer.row(view).reshape(1, -1), view.compute_s.reshape(1, -1),
                   view.cols["loss"].reshape(1, -1), view.cols["mem_rss"].reshape(1, -1),
                   [int(r) for r in view.ranks])
        if row.ranks != self._ranks:  # elastic shrink or grow: per-rank baselines start over
            self._ranks, self._fitted, self._warm = row.ranks, False, []
        if not self._fitted:
            self._warm.append(row)
            if len(self._warm) >= self.config.warmup:
                self._fit()
            self._check_nonfinite(view.step, row)  # a NaN needs no warm-up
            return
        normal = self._check(view.step, row)
        if normal:
            self.straggler.partial_fit(row.compute)
            self.comm.partial_fit(row.col("comm_ratio"))
            self.step_time.partial_fit(row.col("step_s"))
            self.loss.partial_fit(row.col("loss_delta"))
            self.forest.partial_fit(row.multivariate)
        self.memory.partial_fit(row.rss)
        for ep in self.tracker.close_quiet(view.step):
            self.on_close(ep)

    def _fit(self) -> None:
        warm = _Row(*(np.vstack([getattr(w, f) for w in self._warm])
                      for f in ("feats", "compute", "loss", "rss")), self._ranks)
        self.straggler.fit(warm.compute)
        self.comm.fit(warm.col("comm_ratio"))
        self.step_time.fit(warm.col("step_s"))
        self.loss.fit(warm.col("loss_delta"))
        self.memory.fit(warm.rss)
        self.nonfinite.fit(warm.loss)
        self.forest.fit(warm.multivariate)
        self._fitted = True

    def _check_nonfinite(self, step: int, row: "_Row") -> bool:
        bad = self.nonfinite.culprits(row.loss)[0]
        if bad:
            self._flag(step, "nan", 1.0, ranks=[row.ranks[i] for i in bad],
                       evidence={"loss": [str(v) for v in row.loss[0]]})
        return not bad

    def _check(self, step: int, row: "_Row") -> bool:
        """Run every detector on one step; returns whether the step was normal."""
        normal = self._check_nonfinite(step, row)
        ranks, step_s = row.ranks, row.value("step_s")
        usual = float(self.step_time.center_[0])  # one notion of the usual step, for both gates
        if step_s > self.stall * usual:  # no confirmation: it is loud
            self._flag(step, "comm", step_s / usual, ranks=ranks,
                       evidence={"stall_s": round(step_s, 3), "usual_step_s": round(usual, 4)})
            return False
        ratio = -float(self.straggler.score_samples(row.compute)[0])
        self.on_score("straggler", ratio)
        slow = self.straggler.culprits(row.compute)[0]
        comm = row.col("comm_ratio")
        if slow:
            normal = False
            self._flag(step, "straggler", ratio, ranks=[ranks[i] for i in slow], confirm=3,
                       evidence={"compute_s": {str(r): round(float(v), 4) for r, v in zip(ranks, row.compute[0])},
                                 "ratio": round(ratio, 2)})
        elif self.comm.predict(comm)[0] < 0 and step_s > self.comm_slowdown * usual:
            normal = False
            self._flag(step, "comm", -float(self.comm.score_samples(comm)[0]), ranks=ranks,
                       confirm=3, evidence={"comm_ratio": round(row.value("comm_ratio"), 4)})
        delta = row.col("loss_delta")
        if np.isfinite(delta).all() and self.loss.predict(delta)[0] < 0:
            normal = False
            self._flag(step, "loss_spike", -float(self.loss.score_samples(delta)[0]),
                       evidence={"loss_delta": round(row.value("loss_delta"), 4)})
        leak = self.memory.culprits(row.rss)[0]
        if leak:
            normal = False
            self._flag(step, "memory", -float(self.memory.score_samples(row.rss)[0]),
                       ranks=[ranks[i] for i in leak], confirm=2,
                       evidence={"mb_per_step": round(float(self.memory.slopes(row.rss)[0].max()
                                                            * self.memory.mb_per_step), 2)})
        score = float(self.forest.score_samples(row.multivariate)[0])
        self.on_score("isolation_forest", -score)
        trusted = len(self.forest.buffer_) >= 50  # too few rows make IQRs, and so alarms, noisy
        if normal and trusted and score < -self.forest.threshold:
            normal = False
            self._flag(step, "multivariate", -score, confirm=3, evidence={
                "drivers": self.forest.explain(row.multivariate, MULTIVARIATE)[0]})
        return normal

    def _experts(self, expert_load: pd.DataFrame) -> None:
        for step, window in expert_load.groupby("step"):
            if self.last_expert_step >= 0:
                self._expert_spacing = int(step) - self.last_expert_step
            for layer, grp in window.groupby("layer"):
                tokens = grp.sort_values("expert")["tokens"].to_numpy(dtype=float)
                share = (tokens / max(tokens.sum(), 1e-9)).reshape(1, -1)
                det = self.experts.get(layer)
                if det is None or step < self.config.warmup:
                    warm = self._warm_experts.setdefault(layer, [])
                    warm.append(share)
                    if step >= self.config.warmup - 1 or det is not None:
                        self.experts[layer] = ExpertBalance().fit(np.vstack(warm))
                    continue
                hot = det.culprits(share)[0]
                if not hot:
                    det.partial_fit(share)  # routing drifts as the router learns: follow it
                for e in hot:
                    self._flag(int(step), "expert_imbalance", float(det.factors(share)[0][e]),
                               layer=int(layer), expert=int(e), gap=2 * self._expert_spacing,
                               evidence={"share": round(float(share[0][e]), 4),
                                         "usual_share": round(float(det.usual_[e]), 4)})
            self.last_expert_step = int(step)

    def _flag(self, step: int, type: str, score: float, **kw) -> None:
        """Feed the episode tracker; a new episode is announced at once."""
        opened = self.tracker.flag(step, type, score, **kw)
        if opened is not None:
            self.on_open(opened)
