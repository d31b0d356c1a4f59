"""Alertmanager configuration for meshscope: warnings to Slack, criticals to Slack and email,
grouped per run, RankDown silencing StragglerRank for the same rank.

Secrets never enter the generated file: the Slack webhook URL and the SMTP password are read by
Alertmanager from files (`api_url_file`, `smtp_auth_password_file`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TEMPLATE = Path(__file__).parent / "templates" / "meshscope.tmpl"


@dataclass(kw_only=True)
class AlertRouting:
    """Where alerts go. `fast` shortens grouping waits to a second (tests and benchmarks)."""

    slack_webhook_file: Path | None = None
    email_to: list[str] = field(default_factory=list)
    smtp_smarthost: str = "127.0.0.1:25"
    smtp_from: str = "meshscope@localhost"
    smtp_username: str | None = None
    smtp_password_file: Path | None = None
    smtp_require_tls: bool = True
    view_url: str = "http://127.0.0.1:8501"
    fast: bool = False
    check_files: bool = True  # False when the paths are another machine's (a container's secrets)

    def __post_init__(self) -> None:
        if self.email_to and ":" not in self.smtp_smarthost:
            raise ValueError(f"AlertRouting.smtp_smarthost must be host:port, got {self.smtp_smarthost!r}")
        for name in ("slack_webhook_file", "smtp_password_file") if self.check_files else ():
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"AlertRouting.{name}: no such file {path}")


def _abs(path: Path, r: AlertRouting) -> Path:
    return Path(path).resolve() if r.check_files else Path(path)


def _slack(r: AlertRouting) -> list[dict[str, Any]]:
    if r.slack_webhook_file is None:
        return []
    return [
        {
            "api_url_file": str(_abs(r.slack_webhook_file, r)),
            "send_resolved": True,
            "title": '{{ template "meshscope.title" . }}',
            "text": '{{ template "meshscope.text" . }}',
        }
    ]


def _email(r: AlertRouting) -> list[dict[str, Any]]:
    if not r.email_to:
        return []
    return [
        {
            "to": ", ".join(r.email_to),
            "send_resolved": True,
            "headers": {"Subject": '{{ template "meshscope.title" . }}'},
            "text": '{{ template "meshscope.text" . }}',
            "html": '{{ template "meshscope.html" . }}',
        }
    ]


def alertmanager_config(routing: AlertRouting, templates: list[str]) -> dict[str, Any]:
    """Alertmanager's configuration for this routing (secrets by file)."""
    wait, interval, repeat = ("1s", "1s", "1h") if routing.fast else ("10s", "1m", "4h")
    config: dict[str, Any] = {
        "route": {
            "receiver": "slack",
            "group_by": ["alertname", "run"],
            "group_wait": wait,
            "group_interval": interval,
            "repeat_interval": repeat,
            "routes": [{"matchers": ['severity="critical"'], "receiver": "slack-and-email"}],
        },
        "receivers": [
            {"name": "slack", **({"slack_configs": _slack(routing)} if routing.slack_webhook_file else {})},
            {
                "name": "slack-and-email",
                **({"slack_configs": _slack(routing)} if routing.slack_webhook_file else {}),
                **({"email_configs": _email(routing)} if routing.email_to else {}),
            },
        ],
        "inhibit_rules": [
            # a dead rank is slow too: say it is dead, once
            {
                "source_matchers": ['alertname="RankDown"'],
                "target_matchers": ['alertname="StragglerRank"'],
                "equal": ["run", "rank"],
            },
            # a run that failed to recover: one page, not one per rank
            {
                "source_matchers": ['alertname="RecoveryFailed"'],
                "target_matchers": ['alertname="RankDown"'],
                "equal": ["run"],
            },
        ],
        "templates": templates,
    }
    if routing.email_to:
        smtp = {
            "smtp_smarthost": routing.smtp_smarthost,
            "smtp_from": routing.smtp_from,
            "smtp_require_tls": routing.smtp_require_tls,
        }
        if routing.smtp_username:
            smtp["smtp_auth_username"] = routing.smtp_username
        if routing.smtp_password_file:
            smtp["smtp_auth_password_file"] = str(_abs(routing.smtp_password_file, routing))
        config["global"] = smtp
    return config


def view_url_template(view_url: str) -> str:
    """The drill-down view's base URL, as the template `meshscope.view_url` the messages link to."""
    return '{{ define "meshscope.view_url" }}' + view_url.rstrip("/") + "{{ end }}\n"


def write_alertmanager_config(folder: Path, routing: AlertRouting) -> Path:
    """Write `alertmanager.yml` and its templates into `folder` (JSON is valid YAML)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(TEMPLATE, folder / TEMPLATE.name)
    (folder / "view_url.tmpl").write_text(view_url_template(routing.view_url))
    templates = [str((folder / "*.tmpl").resolve())]
    path = folder / "alertmanager.yml"
    path.write_text(json.dumps(alertmanager_config(routing, templates), indent=2))
    return path
