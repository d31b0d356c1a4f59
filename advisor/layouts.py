"""Every uniform layout of a model on a cluster, as columns: one row per (TP, PP, CP, DP, EP,
micro-batch size, interleaving, recompute, distributed optimizer). The cost model reads the
columns whole, so a sweep of 10^5 layouts is a few array operations, not 10^5 Python calls.

Rank order (innermost first) is Megatron's: TP, CP, DP with EP carved from DP x CP, PP
outermost. TP stays inside a node; sequence parallelism is on wherever TP is."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pandas as pd

from meshscope.advisor.specs import AdvisorConfig, ClusterSpec, ModelSpec

RECOMPUTE = ("none", "selective", "full")
COLUMNS = ("tp", "pp", "cp", "dp", "ep", "mb", "m", "v", "recompute", "dist_opt")


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Layout:
    """One layout, as a user would write it (also what a measured run is described as)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    mb: int = 1
    v: int = 1
    recompute: str = "none"
    dist_opt: bool = False

    @property
    def world(self) -> int:
        """Devices the layout uses."""
        return self.tp * self.pp * self.cp * self.dp

    def label(self) -> str:
        """A short name: only the dimensions that are not 1 (or off)."""
        parts = [f"{k}{getattr(self, k)}" for k in ("dp", "tp", "pp", "cp", "ep") if getattr(self, k) > 1]
        parts.append(f"mb{self.mb}")
        if self.v > 1:
            parts.append(f"v{self.v}")
        if self.recompute != "none":
            parts.append(f"rc-{self.recompute}")
        if self.dist_opt:
            parts.append("dopt")
        return " ".join(parts or ["dp1"])


def _grid(model: ModelSpec, cluster: ClusterSpec, cfg: AdvisorConfig) -> list[tuple[int, ...]]:
    """(tp, pp, cp, dp, ep) tuples that use every device and respect the model's shapes."""
    world = cluster.devices
    kv = model.kv_heads or model.heads
    out = []
    for tp in divisors(world):
        if tp > min(cfg.max_tp, cluster.devices_per_node) or model.heads % tp or (kv % tp and tp % kv):
            continue
        for pp in divisors(world // tp):
            if model.layers % pp:
                continue
            for cp in divisors(world // (tp * pp)):
                if cp > cfg.max_cp or model.seq_len % cp:
                    continue
                dp = world // (tp * pp * cp)
                eps = [e for e in divisors(dp * cp) if model.experts % e == 0] if model.experts else [1]
                out += [(tp, pp, cp, dp, ep) for ep in eps]
    return out


def enumerate_layouts(model: ModelSpec, cluster: ClusterSpec, cfg: AdvisorConfig) -> pd.DataFrame:
    """Every uniform layout, one row each; `m` is the micro-batches per step per pipeline."""
    rows = []
    for (tp, pp, cp, dp, ep), mb, v, rc, dopt in itertools.product(
        _grid(model, cluster, cfg), cfg.micro_batches, (1, 2), range(len(RECOMPUTE)), (False, True)
    ):
        if model.global_batch % (dp * mb):
            continue
        if v > 1 and (pp == 1 or (model.layers // pp) % v):
            continue
        if dopt and dp * cp == 1:
            continue
        rows.append((tp, pp, cp, dp, ep, mb, model.global_batch // (dp * mb), v, rc, dopt))
    frame = pd.DataFrame(np.array(rows, dtype=np.int64).reshape(-1, len(COLUMNS)), columns=list(COLUMNS))
    return frame.astype({"dist_opt": bool})


def layout_frame(layouts: list[Layout], model: ModelSpec) -> pd.DataFrame:
    """Given layouts (a measured run's, a user's) in the sweep's columns."""
    rows = [
        (
            lay.tp,
            lay.pp,
            lay.cp,
            lay.dp,
            lay.ep,
            lay.mb,
            max(model.global_batch // (lay.dp * lay.mb), 1),
            lay.v,
            RECOMPUTE.index(lay.recompute),
            lay.dist_opt,
        )
        for lay in layouts
    ]
    return pd.DataFrame(rows, columns=list(COLUMNS)).astype({"dist_opt": bool})


def labels(frame: pd.DataFrame) -> pd.Series:
    """Each row's short name (what `Layout.label` says), built column-wise for a whole sweep."""
    out = pd.Series("", index=frame.index)
    for dim in ("dp", "tp", "pp", "cp", "ep"):
        out += np.where(frame[dim] > 1, dim + frame[dim].astype(str) + " ", "")
    out += "mb" + frame.mb.astype(str)
    out += np.where(frame.v > 1, " v" + frame.v.astype(str), "")
    out += frame.recompute.map(lambda r: f" rc-{RECOMPUTE[r]}" if r else "")
    return out + np.where(frame.dist_opt, " dopt", "")
