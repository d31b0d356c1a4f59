"""The window rules: judgements over tables that arrive in windows rather than per step (expert
load every `expert_every` steps, the gradient inspector's per-layer statistics)."""

from __future__ import annotations

import collections
import statistics

import numpy as np
import pandas as pd

from meshscope.detectors.domain import ExpertLoad
from meshscope.detectors.rules import Flag, WindowRule

NEW_NORMAL_WINDOWS = 10
"""Windows an expert stays imbalanced the same way before its layer's level is learnt as the
new normal: reported once (the episode says so), then the level later faults are judged
against; the boards keep showing it."""


class ExpertRule(WindowRule):
    """An expert takes far more tokens than balance and its usual share (it hogs), or almost
    none (it starves), in units of the balanced share 1/E and the top-k maximum 1/k
    (`detectors.domain.ExpertLoad`); a move toward balance is never an anomaly. Hogging and
    starving are two facets, so an expert that hogs and then starves is two episodes, each
    ending with its own flags; a way that lasts `NEW_NORMAL_WINDOWS` becomes the normal."""

    name, table = "expert_imbalance", "expert_load"
    types = ("expert_imbalance",)

    def __init__(self, warmup: int, hog_min: float, top_k: int | None = None) -> None:
        self.warmup, self.top_k, self.hog_min = warmup, top_k, hog_min
        self.tokens_per_step: float | None = None  # over all ranks, set by the engine
        self.detectors: dict[int, ExpertLoad] = {}
        self._warm: dict[int, list[np.ndarray]] = {}
        self.last_step = -1
        self.spacing = 1
        # (layer, expert) -> (facet, windows in a row it has been flagged that way)
        self.streaks: dict[tuple[int, int], tuple[str, int]] = {}

    def judge(self, frame: pd.DataFrame) -> list[tuple[int, Flag]]:
        out = []
        for step, window in frame[frame["step"] > self.last_step].groupby("step"):
            if self.last_step >= 0:
                self.spacing = int(step) - self.last_step
            for layer, grp in window.groupby("layer"):
                tokens = grp.sort_values("expert")["tokens"].to_numpy(dtype=float)
                if tokens.sum() <= 0:
                    continue
                share = (tokens / tokens.sum()).reshape(1, -1)
                det = self.detectors.get(layer)
                if det is None or step < self.warmup:
                    warm = self._warm.setdefault(layer, [])
                    warm.append(share)
                    if step >= self.warmup - 1 or det is not None:
                        k = self._top_k(tokens.sum(), int(step), len(tokens))
                        self.detectors[layer] = ExpertLoad(top_k=k, hog_min=self.hog_min).fit(np.vstack(warm))
                    continue
                out += self._flags(int(step), int(layer), det, share)
            self.last_step = int(step)
        return out

    def _top_k(self, routed: float, step: int, experts: int) -> int:
        """The run's top-k when known; else from the counts themselves: a layer routes each
        token to k experts, so its window holds k x the tokens the steps processed."""
        if self.top_k is not None:
            return self.top_k
        span = self.spacing if self.last_step >= 0 else step + 1
        if not self.tokens_per_step:
            return 1
        return int(min(experts, max(1, round(routed / (self.tokens_per_step * span)))))

    def _flags(self, step: int, layer: int, det: ExpertLoad, share: np.ndarray) -> list[tuple[int, Flag]]:
        hog, low = det.severities(share)
        experts = share.shape[1]
        flagged = [e for e in range(experts) if hog[0][e] > 0 or low[0][e] > 0]
        facets = {e: "hog" if hog[0][e] > 0 else "starve" for e in flagged}
        settled = self._streak(layer, facets, experts)
        if not flagged or settled:
            det.partial_fit(share)  # routing drifts as the router learns (or settled): follow it
        balance = float(det.balancedness(share)[0])
        return [
            (
                step,
                Flag(
                    "expert_imbalance",
                    float(max(hog[0][e], low[0][e])),
                    layer=layer,
                    expert=e,
                    gap=2 * self.spacing,
                    clock=self.table,
                    facet=facets[e],
                    evidence={
                        "kind": facets[e],
                        "share": round(float(share[0][e]), 4),
                        "usual_share": round(float(det.usual_[e]), 4),
                        "balanced_share": round(1 / experts, 4),
                        "max_share": round(1 / max(1, min(det.top_k, experts)), 4),
                        "balancedness": round(balance, 4),
                        **({"new_normal": round(float(share[0][e]), 4)} if e in settled else {}),
                    },
                ),
            )
            for e in flagged
        ]

    def _streak(self, layer: int, facets: dict[int, str], experts: int) -> set[int]:
        """Count each expert's windows flagged the same way in a row; the experts whose way
        has lasted `NEW_NORMAL_WINDOWS` (their layer's level is then learnt)."""
        settled = set()
        for e in range(experts):
            facet = facets.get(e)
            was, count = self.streaks.get((layer, e), (None, 0))
            count = count + 1 if facet is not None and facet == was else int(facet is not None)
            self.streaks[(layer, e)] = (facet, count)
            if count >= NEW_NORMAL_WINDOWS:
                settled.add(e)
        return settled


class GradientRule(WindowRule):
    """A layer's gradient norm far above its usual one (exploding) or far below (vanishing),
    from the gradient inspector's table (`grad_stats`)."""

    name, table = "gradient", "grad_stats"
    types = ("gradient_exploding", "gradient_vanishing")

    def __init__(self, explode_factor: float = 100.0, vanish_factor: float = 1000.0, warmup: int = 5) -> None:
        self.explode, self.vanish, self.warmup = explode_factor, vanish_factor, warmup
        self.history: dict[str, collections.deque] = {}
        self.last_step = -1

    def judge(self, frame: pd.DataFrame) -> list[tuple[int, Flag]]:
        out = []
        for row in frame[frame["step"] > self.last_step].itertuples():
            history = self.history.setdefault(row.module, collections.deque(maxlen=20))
            g = float(row.grad_norm)
            if not np.isfinite(g):
                continue  # non-finite gradients are the tracer's (a `nan` event)
            if len(history) >= self.warmup:
                usual = statistics.median(history)
                kind = (
                    "gradient_exploding"
                    if usual > 0 and g > usual * self.explode
                    else "gradient_vanishing"
                    if usual > 0 and g < usual / self.vanish
                    else None
                )
                if kind is not None:
                    out.append(
                        (
                            int(row.step),
                            Flag(
                                kind,
                                g / usual,
                                module=row.module,
                                gap=1,
                                clock=self.table,
                                evidence={"module": row.module, "grad_norm": g, "usual": usual},
                            ),
                        )
                    )
                    continue  # an outlier does not become the new usual
            history.append(g)
        if not frame.empty:
            self.last_step = max(self.last_step, int(frame["step"].max()))
        return out
