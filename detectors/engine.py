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
from detectors.features import STEP_FEATURES, complete_steps, rank_compute, step_features
from detectors.isolation import OnlineIsolationForest
from detectors.moving import RobustZ

# Relative features only: levels (tokens/s, step time) drift with the run and the machine.
MULTIVARIATE = ["step_spread", "compute_spread", "comm_ratio", "loss_delta", "grad_norm",
                "mem_slope"]


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
        self.comm = RobustZ(threshold=6.0 / s)
        self.stall = 10.0 / s  # a step this many times the usual: a stuck collective
        self.loss = RobustZ(threshold=8.0 / s)
        self.memory = MemoryGrowth(mb_per_step=2.0 / s)
        self.nonfinite = NonFinite()
        self.forest = OnlineIsolationForest()
        self.experts: dict[int, ExpertBalance] = {}
        self.tracker = EpisodeTracker(gap=self.config.gap)
        self.on_open, self.on_close, self.on_score = on_open, on_close, on_score
        self.last_step = -1
        self.last_expert_step = -1
        self._fitted = False
        self._warm: list[tuple[pd.DataFrame, ...]] = []
        self._ranks: list[int] = []
        self._warm_experts: dict[int, list[np.ndarray]] = {}
        self._expert_spacing = 1

    # --- feeding --------------------------------------------------------------------------
    def process(self, steps: pd.DataFrame, expert_load: pd.DataFrame | None = None) -> None:
        """Judge the steps after the last one seen (only steps every rank has recorded)."""
        steps = complete_steps(steps)
        steps = steps[steps["step"] > self.last_step - 12]  # context for slopes and deltas
        feats = step_features(steps)
        compute = rank_compute(steps).pivot(index="step", columns="rank", values="compute_s")
        loss = steps.pivot(index="step", columns="rank", values="loss")
        rss = steps.pivot(index="step", columns="rank", values="mem_rss")
        for step in feats.index[feats.index > self.last_step]:
            self._step(int(step), feats.loc[[step]], compute.loc[[step]], loss.loc[[step]],
                       rss.loc[[step]])
            self.last_step = int(step)
        if expert_load is not None and not expert_load.empty:
            self._experts(expert_load[expert_load["step"] > self.last_expert_step])

    def finish(self) -> list[Episode]:
        """Close every open episode (end of the run)."""
        done = self.tracker.close_all()
        for ep in done:
            self.on_close(ep)
        return done

    # --- one step -------------------------------------------------------------------------
    def _step(self, step: int, feats: pd.DataFrame, compute: pd.DataFrame, loss: pd.DataFrame,
              rss: pd.DataFrame) -> None:
        # per-rank columns only: the pivot keeps ranks that are gone; the world can change
        present = list(compute.columns[compute.notna().all().to_numpy()])
        compute, loss, rss = compute[present], loss[present], rss[present]
        if present != self._ranks:  # elastic shrink or grow: per-rank baselines start over
            self._ranks, self._fitted, self._warm = present, False, []
        if not self._fitted:
            self._warm.append((feats, compute, loss, rss))
            if len(self._warm) >= self.config.warmup:
                self._fit()
            self._check(step, loss, None)  # a NaN needs no warm-up
            return
        normal = self._check(step, loss, (feats, compute, rss))
        if normal:
            self.straggler.partial_fit(compute.to_numpy())
            self.comm.partial_fit(feats[["comm_ratio"]])
            self.loss.partial_fit(feats[["loss_delta"]])
            self.forest.partial_fit(feats[MULTIVARIATE])
        self.memory.partial_fit(rss.to_numpy())
        for ep in self.tracker.close_quiet(step):
            self.on_close(ep)

    def _fit(self) -> None:
        feats = pd.concat([w[0] for w in self._warm])
        self.straggler.fit(np.vstack([w[1].to_numpy() for w in self._warm]))
        self.comm.fit(feats[["comm_ratio"]])
        self.loss.fit(feats[["loss_delta"]])
        self.memory.fit(np.vstack([w[3].to_numpy() for w in self._warm]))
        self.nonfinite.fit(np.vstack([w[2].to_numpy() for w in self._warm]))
        self.forest.fit(feats[MULTIVARIATE])
        self._fitted = True

    def _check(self, step: int, loss: pd.DataFrame, rest) -> bool:
        """Run every detector on one step; returns whether the step was normal."""
        normal = True
        ranks = list(loss.columns)
        bad = self.nonfinite.culprits(loss.to_numpy())[0]
        if bad:
            normal = False
            self._flag(step, "nan", 1.0, ranks=[ranks[i] for i in bad],
                       evidence={"loss": [str(v) for v in loss.to_numpy()[0]]})
        if rest is None:
            return normal
        feats, compute, rss = rest
        usual = float(np.median(self.straggler.history_.max(axis=1)))
        if float(feats["step_s"].iloc[0]) > self.stall * usual:  # no confirmation: it is loud
            normal = False
            self._flag(step, "comm", float(feats["step_s"].iloc[0]) / usual, ranks=ranks,
                       evidence={"stall_s": round(float(feats["step_s"].iloc[0]), 3),
                                 "usual_step_s": round(usual, 4)})
            return normal
        x = compute.to_numpy()
        ratio = -float(self.straggler.score_samples(x)[0])
        self.on_score("straggler", ratio)
        slow = self.straggler.culprits(x)[0]
        if slow:
            normal = False
            self._flag(step, "straggler", ratio, ranks=[ranks[i] for i in slow], confirm=3,
                       evidence={"compute_s": {str(r): round(float(v), 4) for r, v in zip(ranks, x[0])},
                                 "ratio": round(ratio, 2)})
        elif self.comm.predict(feats[["comm_ratio"]])[0] < 0:
            normal = False
            self._flag(step, "comm", -float(self.comm.score_samples(feats[["comm_ratio"]])[0]),
                       ranks=ranks, confirm=3, evidence={"comm_ratio": round(float(feats["comm_ratio"].iloc[0]), 4)})
        if np.isfinite(feats["loss_delta"].iloc[0]) and self.loss.predict(feats[["loss_delta"]])[0] < 0:
            normal = False
            self._flag(step, "loss_spike", -float(self.loss.score_samples(feats[["loss_delta"]])[0]),
                       evidence={"loss_delta": round(float(feats["loss_delta"].iloc[0]), 4)})
        leak = self.memory.culprits(rss.to_numpy())[0]
        if leak:
            normal = False
            self._flag(step, "memory", -float(self.memory.score_samples(rss.to_numpy())[0]),
                       ranks=[ranks[i] for i in leak], confirm=2,
                       evidence={"mb_per_step": round(float(self.memory.slopes(rss.to_numpy())[0].max()
                                                            * self.memory.mb_per_step), 2)})
        score = float(self.forest.score_samples(feats[MULTIVARIATE])[0])
        self.on_score("isolation_forest", -score)
        trusted = len(self.forest.buffer_) >= 50  # too few rows make IQRs, and so alarms, noisy
        if normal and trusted and self.forest.predict(feats[MULTIVARIATE])[0] < 0:
            normal = False
            self._flag(step, "multivariate", -score, confirm=3, evidence={
                "drivers": self.forest.explain(feats[MULTIVARIATE], MULTIVARIATE)[0]})
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
