"""The one configuration of `meshscope run`: the trainer's sections plus what runs beside it
(alerts, the hang watchdog, detection, the tensor tracer, the stack). TOML, `--set`, the
generated flags and `meshscope config` all read these models; each room owns its section's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from meshscope.alerts.config import AlertsConfig
from meshscope.dashboards.stack_config import StackSettings
from meshscope.detectors.thresholds import EngineConfig
from meshscope.tracer.config import InspectorConfig, TracerConfig
from meshscope.trainer.config import ConfigError, TrainerConfig, merge_settings
from meshscope.trainer.config import load_config as _load
from meshscope.watchdog.config import HangConfig

__all__ = ["ConfigError", "RunConfig", "load_config", "merge_settings"]


class RunConfig(TrainerConfig):
    """Everything `meshscope run` needs: the trainer's settings and the sidecar's."""

    alerts: AlertsConfig = Field(default_factory=AlertsConfig)
    hang: HangConfig = Field(default_factory=HangConfig)
    detect: EngineConfig = Field(default_factory=EngineConfig)
    tracer: TracerConfig = Field(default_factory=TracerConfig)
    gradients: InspectorConfig = Field(default_factory=InspectorConfig)
    stack: StackSettings = Field(default_factory=StackSettings)


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read a TOML (or JSON) run config, apply overrides, validate; ConfigError names the field."""
    return _load(path, overrides, model=RunConfig)
