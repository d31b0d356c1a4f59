"""Alertmanager configuration for meshscope: warnings to Slack, criticals to Slack and email,
grouped per run, RankDown silencing StragglerRank for the same rank.

Secrets never enter the generated file: the Slack webhook URL and the SMTP password are read by
Alertmanager from files (`api_url_file`, `smtp_auth_password_file`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from meshscope.alerts.config import AlertRouting

TEMPLATE = Path(__file__).parent / "templates" / "meshscope.tmpl"


def checked(routing: AlertRouting, check_files: bool = True) -> AlertRouting:
    """ValueError naming the field when Alertmanager could not use `routing`: an SMTP relay
    that is not host:port, or (`check_files`: the paths are this machine's) a missing secret."""
    if routing.email_to:
        host, sep, port = routing.smtp.rpartition(":")
        if not (sep and host and port.isdigit()):
            raise ValueError(f"AlertRouting.smtp must be host:port, got {routing.smtp!r}")
    missing = routing.missing_files() if check_files else []
    if missing:
        raise ValueError(f"AlertRouting.{missing[0]}")
    return routing


def _abs(path: Path, resolve: bool) -> Path:
    return Path(path).resolve() if resolve else Path(path)


def _slack(r: AlertRouting, resolve: bool) -> list[dict[str, Any]]:
    if r.slack_webhook_file is None:
        return []
    return [
        {
            "api_url_file": str(_abs(r.slack_webhook_file, resolve)),
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


def alertmanager_config(
    routing: AlertRouting, templates: list[str], *, fast: bool = False, check_files: bool = True
) -> dict[str, Any]:
    """Alertmanager's configuration for this routing (secrets by file). `fast`: 1 s grouping
    waits (tests, benchmarks); `check_files`: False when the paths are another machine's (a
    container's secrets)."""
    checked(routing, check_files)
    wait, interval, repeat = ("1s", "1s", "1h") if fast else ("10s", "1m", "4h")
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
            {
                "name": "slack",
                **({"slack_configs": _slack(routing, check_files)} if routing.slack_webhook_file else {}),
            },
            {
                "name": "slack-and-email",
                **({"slack_configs": _slack(routing, check_files)} if routing.slack_webhook_file else {}),
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
            "smtp_smarthost": routing.smtp,
            "smtp_from": routing.smtp_from,
            "smtp_require_tls": routing.smtp_tls,
        }
        if routing.smtp_user:
            smtp["smtp_auth_username"] = routing.smtp_user
        if routing.smtp_password_file:
            smtp["smtp_auth_password_file"] = str(_abs(routing.smtp_password_file, check_files))
        config["global"] = smtp
    return config


def view_url_template(view_url: str) -> str:
    """The drill-down view's base URL, as the template `meshscope.view_url` the messages link to."""
    return '{{ define "meshscope.view_url" }}' + view_url.rstrip("/") + "{{ end }}\n"


def write_alertmanager_config(folder: Path, routing: AlertRouting, fast: bool = False) -> Path:
    """Write `alertmanager.yml` and its templates into `folder` (JSON is valid YAML)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(TEMPLATE, folder / TEMPLATE.name)
    (folder / "view_url.tmpl").write_text(view_url_template(routing.view_url))
    templates = [str((folder / "*.tmpl").resolve())]
    path = folder / "alertmanager.yml"
    path.write_text(json.dumps(alertmanager_config(routing, templates, fast=fast), indent=2))
    return path
