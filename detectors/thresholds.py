"""The engine's settings (`EngineConfig`, the `[detect]` section, with `[detect.series]` for
CSV series) and the alarm lines the detection engine and the Prometheus alert rules share.
Light on purpose: every command that reads a config imports it, and the engine's numerics are
not needed for that.

One validated model; the engine reads it (`EngineConfig.thresholds`) and `dashboards/rules/
rules.yml` is rendered from it (`dashboards.prometheus.render_rules`), so a threshold is said
once. `tests/dashboards/test_thresholds.py` proves the rendered rules and the engine reach the
same verdict on the same numbers.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError


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


class SeriesError(ValueError):
    """The input cannot be scored; the message says what to fix."""


class SeriesConfig(BaseModel):
    """Every knob of CSV series detection, validated; the defaults need no tuning."""

    model_config = ConfigDict(extra="forbid")

    alpha: float = Field(1e-4, gt=0, lt=1, description="tail probability below which a row opens an episode")
    pair_alpha: float = Field(
        3e-3,
        gt=0,
        lt=1,
        description="tail probability of two rows in a row that open an episode",
    )
    exit_alpha: float = Field(0.01, gt=0, lt=1, description="tail probability of a quiet row")
    quiet_rows: int = Field(24, ge=1, description="quiet rows that close an episode")
    level_rows: int = Field(5, ge=1, description="rows in the median that predicts the level")
    shift_rows: int = Field(10, ge=2, description="rows averaged to see a small, lasting shift")
    reference_rows: int = Field(100, ge=10, description="rows before them that set the level it shifts from")
    scale_rows: int = Field(1000, ge=20, description="past residuals that set the scale")
    min_rows: int = Field(30, ge=10, description="rows seen before any judgement")
    max_period: int = Field(1500, ge=4, description="longest season looked for, in rows")
    min_autocorrelation: float = Field(0.6, gt=0, lt=1, description="autocorrelation that makes a season")
    period_every: int = Field(500, ge=10, description="rows between re-estimates of the season")
    relative_floor: float = Field(1e-3, gt=0, description="smallest scale, as a share of the range seen")

    @classmethod
    def with_sensitivity(cls, sensitivity: float, **overrides: object) -> SeriesConfig:
        """`sensitivity` > 1 flags more, < 1 flags less: it scales both tail probability thresholds."""
        if not sensitivity > 0:
            raise SeriesError(f"sensitivity must be > 0, got {sensitivity}")
        try:
            config = cls(**overrides)
            scaled = {k: min(0.5, getattr(config, k) * sensitivity) for k in ("alpha", "pair_alpha")}
            return config.model_copy(update=scaled)
        except ValidationError as err:
            first = err.errors()[0]
            raise SeriesError(f"series config: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None


class EngineConfig(BaseModel):
    """How the engine judges (the `[detect]` TOML section). `sensitivity` > 1 flags more, < 1 less."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    warmup: int = Field(20, ge=5, description="steps the detectors learn from before they judge")
    gap: int = Field(3, ge=0, description="quiet steps that close an anomaly episode")
    sensitivity: float = Field(1.0, gt=0, description="> 1 flags more, < 1 flags less")
    thresholds: Thresholds = Field(default_factory=Thresholds)
    series: SeriesConfig = Field(
        default_factory=SeriesConfig, description="scoring a CSV series (`meshscope detect FILE.csv`)"
    )
