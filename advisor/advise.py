"""The search: every uniform layout predicted, the infeasible ones marked with why, the rest
ranked, and the constraint that binds named (what keeps a faster layout out)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from meshscope.advisor.cost import PARTS, Factors, predict
from meshscope.advisor.layouts import enumerate_layouts, labels
from meshscope.advisor.specs import AdvisorConfig, ClusterSpec, ModelSpec

OOM_RISK = 0.8  # share of device memory above which a fitting layout is flagged as a risk


@dataclass
class Advice:
    """The ranked layouts and what the ranking rests on."""

    ranked: pd.DataFrame  # feasible layouts, best first, with `label`, `bound`, `oom_risk`
    excluded: pd.DataFrame  # the rest, with `excluded_by`
    binding: str  # the constraint that keeps a faster layout out, in words
    factors: Factors
    evaluated: int = 0
    notes: list[str] = field(default_factory=list)

    def best(self) -> pd.Series | None:
        """The top layout (None when nothing fits)."""
        return None if self.ranked.empty else self.ranked.iloc[0]


def _bounds(pred: pd.DataFrame) -> np.ndarray:
    """Each layout's largest part of the step."""
    parts = pred[list(PARTS)].to_numpy()
    names = np.array(list(PARTS.values()))
    return names[parts.argmax(axis=1)]


def _exclusions(pred: pd.DataFrame, cluster: ClusterSpec, cfg: AdvisorConfig) -> np.ndarray:
    """'' for a feasible layout, else the first constraint it breaks."""
    limit = cluster.device.memory_gib * cfg.memory_headroom
    return np.select(
        [pred.memory_gib > limit, pred.comm_ratio > cfg.max_comm_ratio],
        [f"memory > {limit:.1f} GiB", f"communication ratio > {cfg.max_comm_ratio:g}"],
        "",
    )


def _binding(ranked: pd.DataFrame, excluded: pd.DataFrame, key: str, cluster: ClusterSpec) -> str:
    """Why the best layout is not faster: the constraint that excluded the layouts ahead of it."""
    if ranked.empty:
        if excluded.empty:
            return "no layout: the model's shapes allow none on this cluster"
        least = excluded.nsmallest(1, "memory_gib").iloc[0]
        have = cluster.device.memory_gib
        return f"nothing fits: the smallest layout needs {least.memory_gib:.1f} GiB of {have:g}"
    ahead = excluded[excluded[key] < ranked.iloc[0][key]]
    if ahead.empty:
        return f"none: the best layout is the fastest of all; its largest part is {ranked.iloc[0].bound}"
    why = ahead.excluded_by.value_counts()
    parts = "; ".join(f"{rule} excludes {n} faster layout{'s' if n > 1 else ''}" for rule, n in why.items())
    return f"{why.index[0].split(' >')[0]}: {parts}"


def advise(
    model: ModelSpec, cluster: ClusterSpec, cfg: AdvisorConfig, factors: Factors | None = None
) -> Advice:
    """Predict every layout of `model` on `cluster`; rank the feasible ones by the goal."""
    factors = factors or Factors()
    layouts = enumerate_layouts(model, cluster, cfg)
    pred = predict(layouts, model, cluster, factors)
    pred["label"] = labels(pred)
    pred["bound"] = _bounds(pred)
    pred["excluded_by"] = _exclusions(pred, cluster, cfg)
    pred["oom_risk"] = pred.memory_gib > cluster.device.memory_gib * OOM_RISK
    key = "step_s" if cfg.goal == "throughput" else "memory_gib"
    order = [key, "memory_gib" if key == "step_s" else "step_s"]
    ranked = pred[pred.excluded_by == ""].sort_values(order, kind="stable").reset_index(drop=True)
    excluded = pred[pred.excluded_by != ""].sort_values(order, kind="stable").reset_index(drop=True)
    advice = Advice(ranked, excluded, _binding(ranked, excluded, key, cluster), factors, len(pred))
    if model.experts and model.expert_skew == 1.0 and "expert_skew" not in factors.measured:
        advice.notes.append(
            "expert load assumed balanced (expert_skew = 1): calibrate on a run to use its skew"
        )
    return advice
