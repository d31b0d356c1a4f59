"""Per-step features from StepRecords and expert load.

Relative features (a rank against the others, a step against its neighbours) are what make
detection work on streams: raw step times drift with the run, ratios do not.

The engine's path is numpy end to end (`step_views` then `StepFeaturizer`): one step of 1,024
ranks must be judged in a few milliseconds, and pandas' groupby/pivot machinery alone costs more.
`step_features` gives the same numbers as a DataFrame for people and notebooks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pandas as pd

from meshscope.collector.figures import compute_seconds
from meshscope.collector.schema import nonfinite_mask

STEP_FEATURES = [
    "step_s",
    "step_spread",
    "compute_spread",
    "comm_ratio",
    "comm_ratio_max",
    "wire_bytes",
    "loss",
    "loss_delta",
    "grad_norm",
    "tokens_per_s",
    "mem_rss",
    "mem_slope",
]
COLUMN = {name: i for i, name in enumerate(STEP_FEATURES)}
_PER_RANK = [
    "step_s",
    "forward_s",
    "comm_exposed_s",
    "data_s",
    "comm_ratio",
    "bytes_wire",
    "loss",
    "grad_norm",
    "tokens",
    "mem_rss",
    "mem_allocated",  # device memory (0 on the CPU)
]


@dataclass
class StepView:
    """One step that every rank of its world has recorded: per-rank arrays ordered by rank."""

    step: int
    ranks: np.ndarray
    cols: dict[str, np.ndarray]

    @property
    def compute_s(self) -> np.ndarray:
        """Step time minus the wait for communication and data. A straggler computes slowly;
        its peers only wait for it."""
        c = self.cols
        return compute_seconds(c["step_s"], c["comm_exposed_s"], c["data_s"])


def _column(steps: pd.DataFrame, name: str) -> np.ndarray:
    """A per-rank column as floats; device memory unknown (an older store, or unread) is 0."""
    if name not in steps.columns:
        return np.zeros(len(steps))
    values = steps[name].to_numpy(dtype=float)
    return np.nan_to_num(values, nan=0.0) if name == "mem_allocated" else values


def step_views(steps: pd.DataFrame, after: int = -1) -> Iterator[StepView]:
    """The complete steps after `after`, in order (a step some rank has not written yet, or
    never will because it died, is left out)."""
    steps = steps[steps["step"] > after]
    if steps.empty:
        return
    step, rank = steps["step"].to_numpy(), steps["rank"].to_numpy()
    order = np.lexsort((rank, step))
    step, rank = step[order], rank[order]
    world = steps["world_size"].to_numpy()[order]
    cols = {c: _column(steps, c)[order] for c in _PER_RANK}
    cols["loss_bad"] = nonfinite_mask(steps, "loss").astype(float)[order]
    # a NaN born in backward (an expert's gradient) leaves the loss finite: the norm says it
    cols["grad_bad"] = np.asarray(nonfinite_mask(steps, "grad_norm"), dtype=float)[order]
    uniq, first, counts = np.unique(step, return_index=True, return_counts=True)
    for s, a, n in zip(uniq, first, counts):
        if n == world[a]:
            yield StepView(int(s), rank[a : a + n], {c: v[a : a + n] for c, v in cols.items()})


# what a Monitor times on some steps only (`detail_every`): NaN on the others
DETAIL_COLUMNS = ("forward_s", "comm_exposed_s", "data_s", "comm_ratio")


class DetailCarry:
    """Each rank's last timed phases stand in for a step that was not timed, so per-rank
    signals stay continuous; whether the step itself was timed is said apart."""

    def __init__(self) -> None:
        self._last: dict[str, np.ndarray] = {}

    def fill(self, view: StepView) -> bool:
        """Fill `view`'s untimed phases in place; whether every rank timed this step."""
        timed = True
        for name in DETAIL_COLUMNS:
            values = view.cols[name]
            missing = np.isnan(values)
            if missing.any():
                timed = False
                last = self._last.get(name)
                known = last if last is not None and last.shape == values.shape else 0.0
                values = view.cols[name] = np.where(missing, known, values)
            self._last[name] = values
        return timed


class StepFeaturizer:
    """Turns consecutive StepViews into rows of STEP_FEATURES; remembers what the deltas and
    the memory slope need (the previous loss, the last `slope_window` memory peaks)."""

    def __init__(self, slope_window: int = 10) -> None:
        self.slope_window = slope_window
        self._last_loss: float | None = None
        self._rss: deque[float] = deque(maxlen=slope_window)

    def row(self, view: StepView) -> np.ndarray:
        """The multivariate features of one step."""
        c = view.cols
        step_s, compute = c["step_s"], view.compute_s
        slowest = max(step_s.max(), 1e-9)
        loss = _finite_mean(c["loss"])  # one rank's NaN is the NaN detector's business
        rss = float(c["mem_rss"].max())
        delta = 0.0
        if np.isfinite(loss):
            delta = 0.0 if self._last_loss is None else loss - self._last_loss
            self._last_loss = loss
        slope = (rss - self._rss[0]) / self.slope_window if len(self._rss) == self.slope_window else 0.0
        self._rss.append(rss)
        return np.array(
            [
                step_s.max(),
                step_s.max() / max(np.median(step_s), 1e-9),
                compute.max() / max(np.median(compute), 1e-9),
                c["comm_ratio"].mean(),
                c["comm_ratio"].max(),
                c["bytes_wire"].mean(),
                loss,
                delta,
                _finite_mean(c["grad_norm"]),
                c["tokens"].sum() / slowest,
                rss,
                slope,
            ]
        )


def _finite_mean(x: np.ndarray) -> float:
    finite = x[np.isfinite(x)]
    return float(finite.mean()) if finite.size else float("nan")


def step_features(steps: pd.DataFrame, slope_window: int = 10) -> pd.DataFrame:
    """One row per complete step (index `step`), columns STEP_FEATURES."""
    featurizer = StepFeaturizer(slope_window)
    views = list(step_views(steps))
    rows = [featurizer.row(v) for v in views]
    return pd.DataFrame(
        rows or None, index=pd.Index([v.step for v in views], name="step"), columns=STEP_FEATURES
    )
