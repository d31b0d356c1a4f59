"""The engine's settings (`EngineConfig`, the `[detect]` section) and the alarm lines the
detection engine and the Prometheus alert rules share. Light on purpose: every command that
reads a config imports it, and the engine's numerics are not needed for that.

One validated model; the engine reads it (`EngineConfig.thresholds`) and `dashboards/rules/
rules.yml` is rendered from it (`dashboards.prometheus.render_rules`), so a threshold is said
once. `tests/dashboards/test_thresholds.py` proves the rendered rules and the engine reach the
same verdict on the same numbers.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Thresholds(BaseModel):
    """Where a measurement becomes an alarm, in the units both the engine and PromQL see."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    straggler_ratio: float = Field(
        1.8,
        gt=1,
        description="a rank's compute time over the median of the other ranks' "
        "(with two ranks: the other's) at which it is a straggler",
    )
    expert_hotness: float = Field(
        0.5,
        gt=0,
        le=1,
        description="an expert's hotness (0 at its fair share 1/E, 1 when "
        "every token goes to it) at which it hogs its layer",
    )
    expert_load_ratio: float = Field(
        2.0,
        gt=1,
        description="an expert's share times the number of experts at which the "
        "ExpertImbalance alert fires (the metrics-only backstop: Prometheus does not know top-k; "
        "the engine judges hotness and reaches people through AnomalyDetected)",
    )
    comm_ratio: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="share of the step spent waiting for communication, "
        "over a minute, at which CommRatioHigh fires",
    )


class EngineConfig(BaseModel):
    """How the engine judges (the `[detect]` TOML section). `sensitivity` > 1 flags more, < 1 less."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    warmup: int = Field(20, ge=5, description="steps the detectors learn from before they judge")
    gap: int = Field(3, ge=0, description="quiet steps that close an anomaly episode")
    sensitivity: float = Field(1.0, gt=0, description="> 1 flags more, < 1 flags less")
    thresholds: Thresholds = Field(default_factory=Thresholds)
