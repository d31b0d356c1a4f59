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
        """a@x,b@y, or a list of those (`--email-to` given once or several times)."""
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return [a.strip() for v in value for a in v.split(",") if a.strip()]
        return value

    def missing_files(self) -> list[str]:
        """`field: path` for each secret file that does not exist (before anything starts)."""
        return [
            f"{name}: no such file {path}"
            for name in ("slack_webhook_file", "smtp_password_file")
            if (path := getattr(self, name)) is not None and not Path(path).is_file()
        ]


class OutboxConfig(BaseModel):
    """How the run's own outbox delivers (embedded alerts; Alertmanager has its own policy)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    dedupe_s: float = Field(
        3600.0, ge=0, description="the same alert to the same channel is sent once in this window"
    )
    per_minute: int = Field(
        20, gt=0, le=10**6, description="alerts per channel per minute; the rest wait in the outbox"
    )
    backoff_s: float = Field(
        1.0, gt=0, description="first retry delay after a failed delivery; doubles each time"
    )
    max_backoff_s: float = Field(300.0, gt=0, description="the longest wait between two retries")


class AlertsConfig(AlertRouting):
    """A run's alerts (the `[alerts]` TOML section; the alert flags override it): the routing,
    and which path carries it."""

    mode: Literal["auto", "alertmanager", "embedded"] = Field(
        "auto",
        description="auto: through Alertmanager when a `meshscope stack` watches the runs "
        "folder, else from the run itself",
    )
    outbox: OutboxConfig = Field(default_factory=OutboxConfig)
