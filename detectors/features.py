"""Per-step features from StepRecords and expert load (pure DataFrame -> DataFrame).

Relative features (a rank against the others, a step against its neighbours) are what make
detection work on streams: raw step times drift with the run, ratios do not.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

STEP_FEATURES = [
    "step_s", "step_spread", "compute_spread", "comm_ratio", "comm_ratio_max", "wire_bytes",
    "loss", "loss_delta", "grad_norm", "tokens_per_s", "mem_rss", "mem_slope",
]


def complete_steps(steps: pd.DataFrame) -> pd.DataFrame:
    """Only steps that every rank of the step's world has recorded."""
    counts = steps.groupby("step")["rank"].transform("nunique")
    return steps[counts == steps["world_size"]]


def rank_compute(steps: pd.DataFrame) -> pd.DataFrame:
    """Per (step, rank): compute seconds = step time minus the wait for communication and data.
    A straggler computes slowly; its peers only wait for it."""
    out = steps[["step", "rank", "step_s"]].copy()
    out["compute_s"] = (steps["step_s"] - steps["comm_exposed_s"] - steps["data_s"]).clip(lower=0)
    return out


def step_features(steps: pd.DataFrame, slope_window: int = 10) -> pd.DataFrame:
    """One row per step (index `step`), columns STEP_FEATURES."""
    steps = complete_steps(steps)
    if steps.empty:
        return pd.DataFrame(columns=STEP_FEATURES)
    comp = rank_compute(steps)
    g = steps.groupby("step")
    cg = comp.groupby("step")["compute_s"]
    f = pd.DataFrame({
        "step_s": g["step_s"].max(),
        "step_spread": g["step_s"].max() / g["step_s"].median().clip(lower=1e-9),
        "compute_spread": cg.max() / cg.median().clip(lower=1e-9),
        "comm_ratio": g["comm_ratio"].mean(),
        "comm_ratio_max": g["comm_ratio"].max(),
        "wire_bytes": g["bytes_wire"].mean(),
        "loss": g["loss"].mean(),
        "grad_norm": g["grad_norm"].mean(),
        "tokens_per_s": g["tokens"].sum() / g["step_s"].max().clip(lower=1e-9),
        "mem_rss": g["mem_rss"].max(),
    })
    f["loss_delta"] = f["loss"].diff().fillna(0.0)
    f["mem_slope"] = (f["mem_rss"].diff(slope_window) / slope_window).fillna(0.0)
    return f[STEP_FEATURES]


def expert_features(expert_load: pd.DataFrame) -> pd.DataFrame:
    """Per (step, layer): imbalance (max/mean), cv, normalised entropy, hot/starved expert."""
    if expert_load.empty:
        return pd.DataFrame(columns=["step", "layer", "imbalance", "cv", "entropy",
                                     "hot_expert", "hot_share", "starved"])
    rows = []
    for (step, layer), grp in expert_load.groupby(["step", "layer"]):
        tokens = grp.sort_values("expert")["tokens"].to_numpy(dtype=float)
        total, n = tokens.sum(), len(tokens)
        share = tokens / total if total > 0 else np.full(n, 1 / n)
        nz = share[share > 0]
        rows.append({
            "step": step, "layer": layer, "imbalance": share.max() * n,
            "cv": share.std() / share.mean(), "entropy": float(-(nz * np.log(nz)).sum() / np.log(n)),
            "hot_expert": int(share.argmax()), "hot_share": float(share.max()),
            "starved": int((share < 0.1 / n).sum())})
    return pd.DataFrame(rows)
