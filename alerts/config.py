"""Where alerts go, said once: the run's own outbox (embedded) and the Alertmanager that
`meshscope stack up` configures read the same `AlertRouting` fields. Secrets stay in files
(or MESHSCOPE_SLACK_WEBHOOK), never in a config."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

VIEW_URL = "http://127.0.0.1:8501"


class AlertRouting(BaseModel):
    """The channels an alert reaches and the view it links to."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    slack_webhook_file: Path | None = Field(None, description="file holding a Slack incoming-webhook URL")
    email_to: list[str] = Field(
        default_factory=list, description="email recipients (critical alerts), a@x,b@y or a list"
    )
    smtp: str = Field("127.0.0.1:25", description="SMTP host:port for email alerts")
    smtp_from: str = Field("meshscope@localhost", description="sender of email alerts")
    smtp_user: str | None = Field(None, description="SMTP login")
    smtp_password_file: Path | None = Field(None, description="file holding the SMTP password")
    smtp_tls: bool = Field(True, description="require STARTTLS for email")
    view_url: str = Field(
        VIEW_URL,
        pattern=r"^https?://\S+$",
        description="the root-cause view (`meshscope view`) alerts link to",
    )

    @field_validator("email_to", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [a.strip() for a in value.split(",") if a.strip()]
        return value

    def missing_files(self) -> list[str]:
        """`field: path` for each secret file that does not exist (before anything starts)."""
        return [
            f"{name}: no such file {path}"
            for name in ("slack_webhook_file", "smtp_password_file")
            if (path := getattr(self, name)) is not None and not Path(path).is_file()
        ]


class AlertsConfig(AlertRouting):
    """A run's alerts (the `[alerts]` TOML section; the alert flags override it): the routing,
    and which path carries it."""

    mode: Literal["auto", "alertmanager", "embedded"] = Field(
        "auto",
        description="auto: through Alertmanager when a `meshscope stack` watches the runs "
        "folder, else from the run itself",
    )
    stack_home: Path = Field(
        Path(".meshscope/stack"), description="where `meshscope stack up` keeps its state"
    )
