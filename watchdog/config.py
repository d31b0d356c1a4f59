"""The hang watchdog's settings, apart from the watchdog: the run's one config (and `meshscope
config`) reads them without importing what watching needs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from meshscope.collector.figures import HANG_FLOOR_S, STALL_STEP_FACTOR, stall_threshold_s


class HangConfig(BaseModel):
    """When a stall counts as a hang, and what to do about it (the `[hang]` TOML section)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_stall_s: float = Field(
        HANG_FLOOR_S, gt=0, description="never call a stall shorter than this a hang (`--hang-after`)"
    )
    step_factor: float = Field(
        STALL_STEP_FACTOR,
        gt=0,
        description="...nor one shorter than this many typical steps (slow models get longer)",
    )
    startup_s: float = Field(
        120.0, gt=0, description="before the first step finishes there is no step time: this long is a hang"
    )
    poll_s: float = Field(0.25, gt=0, description="how often the flight-log headers are read")
    stacks_wait_s: float = Field(1.5, gt=0, description="how long the live ranks get to answer with stacks")
    on_hang: Literal["report", "abort"] = Field(
        "report",
        description="report: event, metric and alert; abort: also kill the workers, so the "
        "elastic agent restarts them from the last checkpoint",
    )

    def threshold_s(self, step_s: float) -> float:
        """Seconds without progress that make a hang, given the typical step time."""
        if step_s <= 0:
            return self.startup_s
        return stall_threshold_s(step_s, floor_s=self.min_stall_s, factor=self.step_factor)
