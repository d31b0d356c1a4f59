"""StepRecord and Event: the two records every meshscope component speaks."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, TypedDict

EVENT_KINDS = frozenset(
    {
        "anomaly",
        "fault",
        "restart",
        "resume",
        "hang",
        "nan",
        "snapshot",
        "placement_proposed",  # live expert re-placement: the change, expected balance before/after
        "suggestion",
        "suggestion_applied",
        "approval",  # who approved a suggestion, and the control change it queued
        "outcome",
        "injected",
        "run_start",
        "run_end",
        "host",
        "checkpoint",
        "info",
    }
)
SEVERITIES = ("info", "warning", "critical")
# What the meter times apart: the hops of a reduction across nodes, and expert parallelism's
# all-to-all (dispatch and combine, forward and backward)
HOP_KINDS = ("intra_node", "inter_node", "expert_all_to_all")


@dataclass(slots=True, kw_only=True)
class StepRecord:
    """One training step on one rank. Times in seconds, sizes in bytes."""

    run_id: str
    rank: int
    world_size: int
    step: int
    time: float
    step_s: float
    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    data_s: float = 0.0
    comm_total_s: float = 0.0
    comm_exposed_s: float = 0.0
    comm_ratio: float = 0.0
    bytes_raw: int = 0
    bytes_wire: int = 0
    comm_intra_s: float = math.nan
    """Communication inside the node, where a hook times its hops apart (NaN: not apart)."""
    comm_inter_s: float = math.nan
    """Communication across nodes, likewise (the hierarchical all-reduce's middle hop)."""
    bytes_inter: int = 0
    """This rank's share of the gradient bytes that crossed the node boundary."""
    comm_a2a_s: float = math.nan
    """Expert parallelism's all-to-all (NaN: no expert parallelism): the step waits for it, so
    it counts in `comm_exposed_s` and `comm_total_s` too."""
    bytes_a2a: int = 0
    """Bytes this rank sent in the expert all-to-all (token slots out and results back)."""
    loss: float = math.nan
    grad_norm: float = math.nan
    tokens: int = 0
    tokens_per_s: float = 0.0
    mem_allocated: int = 0
    mem_reserved: int = 0
    mem_rss: int = 0
    nonfinite: str = ""
    """Logged scalars that were NaN or Inf, comma-separated. The store keeps a NaN as NULL,
    like a value never logged: this says which it was (an unlogged loss is not a NaN loss)."""
    attempt: int = 0
    """Which attempt of the job ran the step (torchrun's restart count). A step redone after a
    restart replaces the earlier attempt's row in `steps`; that row moves to `steps_retried`."""


STEP_COLUMNS = tuple(f.name for f in dataclasses.fields(StepRecord))


def nonfinite_mask(steps: Any, name: str = "loss") -> Any:
    """Rows of a steps DataFrame whose logged `name` was NaN/Inf (never: not logged). A store
    from before the `nonfinite` column: a missing value counts only on a rank that logged
    `name` at all in these rows."""
    import numpy as np

    values = steps[name].to_numpy(dtype=float)
    if "nonfinite" in steps.columns:
        notes = steps["nonfinite"]
        if not notes.astype(bool).any():  # the usual case, and cheap at 1,024 ranks a step
            return np.isinf(values)
        said = notes.fillna("").astype(str).str.contains(rf"(?:^|,){name}(?:,|$)", regex=True).to_numpy()
        return said | np.isinf(values)
    finite = np.isfinite(values)
    ranks = steps["rank"].to_numpy()
    return ~finite & np.isin(ranks, np.unique(ranks[finite]))


@dataclass(slots=True, kw_only=True)
class Event:
    """Something that happened: a fault, a restart, an anomaly, a snapshot...

    `detail` is free-form JSON; each producer documents the keys it writes.
    """

    kind: str
    run_id: str
    severity: str = "info"
    rank: int | None = None
    step: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"Event.kind: {self.kind!r} is not one of {sorted(EVENT_KINDS)}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"Event.severity: {self.severity!r} is not one of {SEVERITIES}")


class AnomalyDetail(TypedDict, total=False):
    """The detail of an `anomaly` event (written by the engine's episodes)."""

    type: str
    ranks: list[int]
    start_step: int
    end_step: int
    announced_step: int
    score: float
    layer: int | None
    expert: int | None
    module: str | None
    evidence: dict[str, Any]


class HangDetail(TypedDict, total=False):
    """The detail of a `hang` event (written by the watchdog's diagnosis)."""

    type: str
    culprit_ranks: list[int]
    waiting_ranks: list[int]
    op: str | None
    seq: int | None
    group: str | None
    why: str
    stacks: dict[str, list[str]]
    action: str
    step: int | None


ANOMALY_IDENTITY = ("type", "start_step", "end_step", "ranks", "layer", "expert", "module")


def anomaly_key(detail: AnomalyDetail | dict[str, Any]) -> tuple:
    """What makes two anomaly events the same episode (judging a run twice writes it once; an
    alert and the view name it the same way)."""
    return tuple(tuple(detail.get(k) or ()) if k == "ranks" else detail.get(k) for k in ANOMALY_IDENTITY)


def anomaly_link(detail: AnomalyDetail | dict[str, Any]) -> dict[str, str]:
    """How a link names an anomaly that may not be stored yet (an alert goes out as the episode
    opens): its type and first step, and its rank and layer when it has one. The view's
    `resolve_link` reads the same keys."""
    ranks = list(detail.get("ranks") or [])
    params = {
        "type": detail.get("type"),
        "start": detail.get("start_step"),
        "rank": ranks[0] if len(ranks) == 1 else None,
        "layer": detail.get("layer"),
    }
    return {k: str(v) for k, v in params.items() if v is not None}
