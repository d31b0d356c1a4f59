"""Where a run's alerts go, settled before anything starts: the run's own channels (Slack,
email) or a stack's Alertmanager. Light on purpose: `meshscope run` checks it first, while
the warm standby and the sidecar are still to come."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshscope.alerts.notify import Email, SlackWebhook, parse_host_port, read_secret


@dataclass
class AlertPath:
    """Where this run's alerts go: its own channels (embedded), or a stack's Alertmanager."""

    channels: list = field(default_factory=list)
    alertmanager: str | None = None
    ignored_channels: bool = False  # channels were given but Alertmanager pages instead


def alert_channels(alerts: Any) -> list:
    """Alert channels from the `alerts` config (TOML and flags) and secrets (files or
    environment); AlertSettingError (a ValueError naming the flag) when one is unusable."""
    channels = []
    url = read_secret(
        file=alerts.slack_webhook_file, env="MESHSCOPE_SLACK_WEBHOOK", flag="--slack-webhook-file"
    )
    if url:
        channels.append(SlackWebhook(url))
    if alerts.email_to:
        host, port = parse_host_port(alerts.smtp, "--smtp")
        channels.append(
            Email(
                host,
                port,
                alerts.smtp_from,
                alerts.email_to,
                username=alerts.smtp_user,
                password=read_secret(file=alerts.smtp_password_file, flag="--smtp-password-file"),
                starttls=alerts.smtp_tls,
            )
        )
    return channels


def alert_path(cfg: Any) -> AlertPath:
    """One alert path: a run under a stack's Prometheus alerts through its Alertmanager (the
    AnomalyDetected and HangDetected rules), never also from its own outbox; otherwise the run
    sends to its own channels. ValueError naming the flag when it cannot be."""
    from meshscope.dashboards.stack import alerting_for

    alerts = cfg.alerts
    channels = alert_channels(alerts)  # checked before any write
    alertmanager = alerting_for(cfg.stack.home, cfg.runs_root) if alerts.mode != "embedded" else None
    if alerts.mode == "alertmanager" and alertmanager is None:
        raise ValueError(
            f"--alerts alertmanager: no meshscope stack in {cfg.stack.home} watches "
            f"{cfg.runs_root} (start one: meshscope stack up --runs {cfg.runs_root})"
        )
    if alertmanager is None:
        return AlertPath(channels)
    return AlertPath([], alertmanager, ignored_channels=bool(channels))
