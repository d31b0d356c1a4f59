"""Alerts to Slack (incoming webhook) and email (SMTP) that are never lost.

Every alert is first written to an on-disk outbox (one JSON file each, written atomically);
`deliver()` sends what is due, with de-duplication, a per-channel rate limit and retries with
exponential backoff. An endpoint that is down keeps its alerts in the outbox until it is back.
Secrets (webhook URL, SMTP password) come from a file or an environment variable and are never
logged: messages name the channel, not its address.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import smtplib
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from email.message import EmailMessage
from pathlib import Path
from typing import Any, Protocol

from meshscope.alerts.config import OutboxConfig
from meshscope.collector.exporter import split_host_port

log = logging.getLogger("meshscope.notify")


class AlertSettingError(ValueError):
    """An alert flag or secrets file is unusable; the message names the flag."""


def parse_host_port(value: str, flag: str = "--smtp") -> tuple[str, int]:
    """`host:port` -> (host, port); AlertSettingError naming the flag otherwise."""
    parsed = split_host_port(value)
    if parsed is None:
        raise AlertSettingError(f"{flag} {value!r}: expected HOST:PORT with a port 1-65535")
    return parsed


def read_secret(
    *,
    file: str | Path | None = None,
    env: str | None = None,
    environ: dict[str, str] | None = None,
    flag: str = "secret file",
) -> str | None:
    """A secret from a file (first line) or an environment variable; None when neither is set.
    An unreadable or empty file is an AlertSettingError naming `flag`."""
    if file:
        try:
            text = Path(file).read_text().strip()
        except (OSError, UnicodeDecodeError) as err:
            why = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
            raise AlertSettingError(f"{flag} {file}: cannot read it ({why})") from None
        if not text:
            raise AlertSettingError(f"{flag} {file}: the file is empty")
        return text
    if env:
        return (environ if environ is not None else os.environ).get(env) or None
    return None


@dataclass(frozen=True)
class Alert:
    """What a person is told: a title, the facts, and a key that says "the same alert"."""

    title: str
    severity: str
    facts: dict[str, Any]
    key: str

    @classmethod
    def from_anomaly(cls, run_id: str, detail: dict[str, Any], link: str = "") -> Alert:
        """The alert for an anomaly episode as it opens."""
        where = ", ".join(f"{k}={detail[k]}" for k in ("ranks", "layer", "expert") if k in detail)
        facts = {
            "run": run_id,
            **{
                k: detail[k]
                for k in ("type", "ranks", "layer", "expert", "score", "start_step", "end_step")
                if k in detail
            },
        }
        if link:
            facts["link"] = link
        ident = json.dumps(
            [
                run_id,
                detail.get("type"),
                detail.get("ranks"),
                detail.get("layer"),
                detail.get("expert"),
                detail.get("start_step"),
            ],
            default=str,
        )
        return cls(
            title=f"[meshscope] {detail.get('type', 'anomaly')} in {run_id} ({where})",
            severity="warning",
            facts=facts,
            key=hashlib.sha1(ident.encode()).hexdigest()[:16],
        )

    @classmethod
    def from_hang(cls, run_id: str, detail: dict[str, Any], link: str = "") -> Alert:
        """A hang or broken collective: who is to blame, in which collective, and why."""
        facts = {
            "run": run_id,
            **{
                k: detail[k]
                for k in ("type", "culprit_ranks", "op", "seq", "group", "waiting_ranks", "why")
                if detail.get(k) is not None
            },
        }
        if link:
            facts["link"] = link
        ident = json.dumps(
            [run_id, "hang", detail.get("culprit_ranks"), detail.get("group"), detail.get("seq")], default=str
        )
        return cls(
            title=f"[meshscope] hang in {run_id}: culprit ranks "
            f"{detail.get('culprit_ranks')} ({detail.get('type')})",
            severity="critical",
            facts=facts,
            key=hashlib.sha1(ident.encode()).hexdigest()[:16],
        )

    def text(self) -> str:
        """Title and facts as plain text (Slack text, email body)."""
        return self.title + "\n" + "\n".join(f"{k}: {v}" for k, v in self.facts.items())


class Channel(Protocol):
    """Where an alert is delivered (Slack, email, a webhook): one `send` each."""

    name: str

    def send(self, alert: Alert) -> None:
        """Deliver or raise."""


class SlackWebhook:
    """Posts alerts to a Slack incoming webhook (the URL is the secret)."""

    def __init__(self, url: str, name: str = "slack", timeout_s: float = 5.0) -> None:
        self.name, self._url, self.timeout_s = name, url, timeout_s

    def send(self, alert: Alert) -> None:
        """Post one alert; raises on an HTTP error so the outbox retries."""
        body = json.dumps({"text": alert.text()}).encode()
        req = urllib.request.Request(self._url, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            if resp.status >= 300:
                raise OSError(f"{self.name}: HTTP {resp.status}")

    def __repr__(self) -> str:  # never show the URL: it is the secret
        return f"SlackWebhook(name={self.name!r})"


class Email:
    """Sends alerts by SMTP (STARTTLS unless turned off)."""

    def __init__(
        self,
        host: str,
        port: int,
        sender: str,
        to: list[str],
        *,
        username: str | None = None,
        password: str | None = None,
        starttls: bool = True,
        name: str = "email",
        timeout_s: float = 5.0,
    ) -> None:
        self.name, self.host, self.port, self.sender, self.to = name, host, port, sender, to
        self.username, self._password, self.starttls = username, password, starttls
        self.timeout_s = timeout_s

    def send(self, alert: Alert) -> None:
        """Send one alert; raises on an SMTP error so the outbox retries."""
        msg = EmailMessage()
        msg["Subject"], msg["From"], msg["To"] = alert.title, self.sender, ", ".join(self.to)
        msg.set_content(alert.text())
        with smtplib.SMTP(self.host, self.port, timeout=self.timeout_s) as smtp:
            if self.starttls:
                smtp.starttls()
            if self.username and self._password:
                smtp.login(self.username, self._password)
            smtp.send_message(msg)

    def __repr__(self) -> str:
        return f"Email(name={self.name!r}, host={self.host!r}, to={self.to!r})"


class Outbox:
    """A folder of pending alerts and the bookkeeping to deliver them exactly once."""

    def __init__(
        self,
        folder: Path,
        channels: list[Channel],
        config: OutboxConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.channels = {c.name: c for c in channels}
        self.config = config or OutboxConfig()
        self.clock = clock
        self._sent_path = self.folder / "sent.json"
        self._sent: dict[str, float] = (
            json.loads(self._sent_path.read_text()) if self._sent_path.exists() else {}
        )
        self._recent: dict[str, list[float]] = {}

    def put(self, alert: Alert, channels: list[str] | None = None) -> list[Path]:
        """Queue an alert for each channel (all by default): on disk before anything is sent."""
        paths = []
        for name in channels or list(self.channels):
            record = {"alert": alert.__dict__, "channel": name, "attempts": 0, "due": self.clock()}
            path = self.folder / f"{alert.key}-{name}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, default=str))
            os.replace(tmp, path)
            paths.append(path)
        return paths

    def pending(self) -> list[Path]:
        """Alerts written and not yet delivered, oldest first."""
        return sorted(p for p in self.folder.glob("*.json") if p.name != "sent.json")

    def deliver(self) -> int:
        """Send what is due; returns how many were delivered now."""
        delivered = 0
        for path in self.pending():
            record = json.loads(path.read_text())
            alert, name = Alert(**record["alert"]), record["channel"]
            sent_key = f"{alert.key}/{name}"
            now = self.clock()
            if now - self._sent.get(sent_key, -1e18) < self.config.dedupe_s:
                path.unlink()  # a duplicate: already delivered in the window
                continue
            if record["due"] > now or not self._allowed(name, now):
                continue
            try:
                self.channels[name].send(alert)
            except (OSError, smtplib.SMTPException, urllib.error.URLError) as err:
                record["attempts"] += 1
                delay = min(self.config.backoff_s * 2 ** (record["attempts"] - 1), self.config.max_backoff_s)
                record["due"] = now + delay
                path.write_text(json.dumps(record, default=str))
                log.warning(
                    "alert %s to %s failed (%s); retry in %.0f s", alert.key, name, type(err).__name__, delay
                )
                continue
            self._recent.setdefault(name, []).append(now)
            self._sent[sent_key] = now
            self._sent_path.write_text(json.dumps(self._sent))
            path.unlink()
            delivered += 1
        return delivered

    def _allowed(self, channel: str, now: float) -> bool:
        recent = [t for t in self._recent.get(channel, []) if now - t < 60]
        self._recent[channel] = recent
        return len(recent) < self.config.per_minute
