"""The view's settings: one validated model, filled from the environment `meshscope view` sets
(Streamlit runs the app in its own process, so flags travel as MESHSCOPE_VIEW_* variables)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ENV_PREFIX = "MESHSCOPE_VIEW_"


class ViewSettings(BaseModel):
    """Where the view reads from and what it links to."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    runs_dir: Path = Field(Path("runs"), description="folder of run directories (read-only)")
    host: str = Field("127.0.0.1", description="address the view listens on")
    port: int = Field(8501, gt=0, lt=65536, description="port the view listens on")
    grafana_url: str | None = Field(None, description="Grafana base URL for board links")
    prometheus_url: str | None = Field(None, description="Prometheus for live runs (optional)")
    changes_token_file: Path | None = Field(
        None,
        description="with it, the Feedback page may queue changes to a live job, each approval "
        "giving this file's token; without it the view only reads",
    )
    outcome_after: int = Field(
        50, gt=0, description="steps after an applied change before its outcome is measured"
    )

    def env(self) -> dict[str, str]:
        """These settings as the environment the app process reads back."""
        return {ENV_PREFIX + k.upper(): str(v) for k, v in self.model_dump().items() if v is not None}

    @classmethod
    def from_env(cls) -> ViewSettings:
        """Read MESHSCOPE_VIEW_*; a bad value raises ValueError naming the variable."""
        values = {
            name: os.environ[ENV_PREFIX + name.upper()]
            for name in cls.model_fields
            if ENV_PREFIX + name.upper() in os.environ
        }
        try:
            return cls(**values)
        except ValidationError as err:
            first = err.errors()[0]
            raise ValueError(f"{ENV_PREFIX}{str(first['loc'][0]).upper()}: {first['msg']}") from None
