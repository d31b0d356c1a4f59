"""The control channel's contract: changes a person approved for a running trainer.

A change is written to the run store's `controls` table (status `pending`) by the view or
`meshscope feedback apply`; the trainer's rank 0 reads it at a step boundary, the control plane
hands it to every rank, all ranks apply it at the same step, and rank 0 settles it (`applied`
with the step, old and new values, or `refused` with why). Bounds are checked when a change is
written and again when it is applied: a value outside them never reaches the model.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from meshscope.collector.store import execute, fetch, read_frame

ControlKind = Literal["router_bias", "aux_loss_coef", "capacity_factor", "expert_placement"]
KIND_CODES = {"router_bias": 1, "aux_loss_coef": 2, "capacity_factor": 3, "expert_placement": 4}


class ControlBounds(BaseModel):
    """What a change may set: the limits a running trainer accepts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bias_max: float = Field(5.0, gt=0, description="|router bias| per expert, in logit units")
    bias_rate_max: float = Field(0.05, ge=0, description="aux-loss-free bias update speed γ")
    aux_loss_coef_max: float = Field(1.0, ge=0, description="load-balancing loss weight")
    capacity_factor_min: float = Field(1.0, gt=0, description="expert capacity factor, lowest")
    capacity_factor_max: float = Field(8.0, gt=0, description="expert capacity factor, highest")


BOUNDS = ControlBounds()


class ControlError(ValueError):
    """A change that is malformed or out of bounds; the message names the field."""


class ControlChange(BaseModel):
    """One change: what to set, on which MoE layer (-1: every layer), to which values.

    router_bias: values = [γ, b_0 .. b_{E-1}] (the bias update speed, then each expert's bias);
    aux_loss_coef and capacity_factor: values = [value]; expert_placement (expert parallelism):
    values = the expert each slot holds, rank-major (E/ep slots per rank of an EP group)."""

    model_config = ConfigDict(extra="forbid")

    kind: ControlKind
    layer: int = Field(-1, ge=-1)
    values: list[float] = Field(min_length=1, max_length=4096)

    @model_validator(mode="after")
    def _within_bounds(self) -> ControlChange:
        self.check(BOUNDS)
        return self

    def check(self, bounds: ControlBounds) -> None:
        """ValueError naming the value that is out of `bounds`."""
        v = self.values
        if any(x != x or x in (float("inf"), float("-inf")) for x in v):
            raise ValueError("values: must be finite numbers")
        if self.kind == "router_bias":
            if len(v) < 2:
                raise ValueError("values: router_bias takes [rate, bias per expert...]")
            if not 0 <= v[0] <= bounds.bias_rate_max:
                raise ValueError(f"values[0] (rate γ) {v[0]} outside [0, {bounds.bias_rate_max}]")
            bad = [x for x in v[1:] if abs(x) > bounds.bias_max]
            if bad:
                raise ValueError(f"values: bias {bad[0]} outside ±{bounds.bias_max}")
        elif self.kind == "expert_placement":
            if sorted(v) != list(range(len(v))):
                raise ValueError("values: an expert placement lists every expert 0..E-1 once")
            if self.layer < 0:
                raise ValueError("layer: an expert placement is for one layer")
        elif len(v) != 1:
            raise ValueError(f"values: {self.kind} takes one value")
        elif self.kind == "aux_loss_coef" and not 0 <= v[0] <= bounds.aux_loss_coef_max:
            raise ValueError(f"values[0] (aux_loss_coef) {v[0]} outside [0, {bounds.aux_loss_coef_max}]")
        elif self.kind == "capacity_factor" and not (
            bounds.capacity_factor_min <= v[0] <= bounds.capacity_factor_max
        ):
            raise ValueError(
                f"values[0] (capacity_factor) {v[0]} outside "
                f"[{bounds.capacity_factor_min}, {bounds.capacity_factor_max}]"
            )

    @classmethod
    def parse(cls, data: dict[str, Any]) -> ControlChange:
        """Validate; ControlError naming the field otherwise."""
        try:
            return cls(**data)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ControlError(
                f"control {where + ': ' if where else ''}{first['msg'].removeprefix('Value error, ')}"
            ) from None
        except TypeError as err:
            raise ControlError(f"control: {err}") from None


def submit(run_dir: str | Path, change: ControlChange, suggestion: int | None = None) -> int:
    """Queue an approved change for the running trainer; its id."""
    change.check(BOUNDS)
    rows = execute(
        run_dir,
        "INSERT INTO controls (created, kind, layer, payload, suggestion, status) "
        "VALUES (?, ?, ?, ?, ?, 'pending') RETURNING id",
        (time.time(), change.kind, change.layer, json.dumps(change.values), suggestion),
    )
    return int(rows[0][0])


def pending(run_dir: str | Path) -> list[tuple[int, ControlChange]]:
    """Changes not yet applied, oldest first (cheap enough to poll at step boundaries)."""
    sql = "SELECT id, kind, layer, payload FROM controls WHERE status = 'pending' ORDER BY id"
    rows = fetch(run_dir, sql)
    return [
        (int(i), ControlChange.model_construct(kind=k, layer=int(layer), values=json.loads(p)))
        for i, k, layer, p in rows
    ]


def settle(
    run_dir: str | Path,
    control_id: int,
    *,
    status: str,
    step: int | None,
    old: Any = None,
    new: Any = None,
    note: str = "",
) -> None:
    """Record what became of a change (applied or refused)."""
    execute(
        run_dir,
        "UPDATE controls SET status = ?, step = ?, old = ?, new = ?, note = ? WHERE id = ?",
        (status, step, json.dumps(old), json.dumps(new), note, control_id),
    )


def record_outcome(run_dir: str | Path, control_id: int, outcome: dict[str, Any]) -> None:
    """Attach a measured outcome to an applied change."""
    execute(run_dir, "UPDATE controls SET outcome = ? WHERE id = ?", (json.dumps(outcome), control_id))


CONTROL_COLUMNS = tuple("id created kind layer payload suggestion status step old new note outcome".split())


def load_controls(run_dir: str | Path):
    """Every change of a run, with its fate, as a DataFrame (payload/old/new/outcome decoded)."""
    import pandas as pd

    try:
        df = read_frame(run_dir, "SELECT * FROM controls ORDER BY id")
    except (FileNotFoundError, pd.errors.DatabaseError):  # no store, or one from before the table
        return pd.DataFrame(columns=list(CONTROL_COLUMNS))
    for c in ("payload", "old", "new", "outcome"):
        df[c] = [json.loads(x) if isinstance(x, str) else None for x in df[c]]
    return df


def placement_at(
    run_dir: str | Path, layer: int, experts: int, step: int | None = None
) -> tuple[list[int], int | None]:
    """The expert placement of `layer` in force at `step` (now, without one): the last applied
    `expert_placement` change, else experts in order; and the step it was applied at."""
    rows = load_controls(run_dir)
    if rows.empty:
        return list(range(experts)), None
    placed = (rows["kind"] == "expert_placement") & (rows["status"] == "applied") & (rows["layer"] == layer)
    if step is not None:
        placed &= rows["step"] <= step
    mine = rows[placed]
    if mine.empty:
        return list(range(experts)), None
    last = mine.sort_values("id").iloc[-1]
    return [int(x) for x in last["payload"]], int(last["step"])
