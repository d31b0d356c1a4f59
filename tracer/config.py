"""The tracer's settings, apart from the tracer: the run's one config (and `meshscope config`)
reads them without importing torch. The `[tracer]` and `[gradients]` TOML sections."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

TraceMode = Literal["off", "nonfinite", "stats", "full"]


class TracerConfig(BaseModel):
    """What the tensor tracer does (`meshscope.tracer.trace` explains the modes)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    mode: TraceMode = Field(
        "nonfinite",
        description="off | nonfinite (first non-finite module, every step) | stats (+ per-module "
        "statistics) | full (+ snapshots)",
    )
    stats_every: int = Field(10, ge=1, le=10**6, description="stats and full: statistics every N steps")
    max_snapshots: int = Field(
        5, ge=0, le=10**6, description="snapshots per rank per run (full: per finding, up to this)"
    )
    repeat_after: int = Field(
        100, ge=1, le=10**9, description="the same module, phase and tensor is reported again N steps later"
    )
    exchanges: bool = Field(
        True,
        description="under expert parallelism (where no re-run can place a NaN), sum what each "
        "exchange sent and received, so the rank whose experts or own layers made one names "
        "them; reads each exchanged value once (benchmarks/tracer_overhead.py --ep 2)",
    )
    max_lag_steps: int = Field(
        32,
        ge=1,
        le=10**6,
        description="steps whose flags may wait for a lagging device; past it the tracer waits "
        "for the oldest (a sync point) rather than drop a flag unjudged",
    )


class InspectorConfig(BaseModel):
    """When the gradient inspector (rank 0, per-layer gradient norm and update ratio) judges."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    every: int = Field(10, ge=1, le=10**6, description="inspect one step in N")
