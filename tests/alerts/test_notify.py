"""Alerts against a local Slack-style webhook sink and a local SMTP server (aiosmtpd)."""

import logging

import pytest
from aiosmtpd.controller import Controller

from fixtures.ports import free_port_range
from fixtures.sinks import Sink
from meshscope.alerts.notify import Alert, Email, Outbox, OutboxConfig, SlackWebhook, read_secret

DETAIL = {"type": "straggler", "ranks": [1], "score": 2.9, "start_step": 40, "end_step": 47}


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture
def sink():
    s = Sink()
    yield s
    s.stop()


def test_slack_alert_carries_run_rank_and_link(tmp_path, sink):
    sink.start()
    box = Outbox(tmp_path, [SlackWebhook(f"http://127.0.0.1:{sink.port}/hook")])
    box.put(Alert.from_anomaly("run-7", DETAIL, link="http://127.0.0.1:8501/?run=run-7"))
    assert box.deliver() == 1
    text = sink.received[0]["text"]
    assert "straggler in run-7" in text and "ranks: [1]" in text and "?run=run-7" in text
    assert box.pending() == []


def test_email_reaches_a_local_smtp_server(tmp_path):
    messages = []

    class Handler:
        async def handle_DATA(self, server, session, envelope):
            messages.append(envelope)
            return "250 OK"

    port = free_port_range(1)
    controller = Controller(Handler(), hostname="127.0.0.1", port=port)
    controller.start()
    try:
        box = Outbox(
            tmp_path, [Email("127.0.0.1", port, "meshscope@localhost", ["oncall@localhost"], starttls=False)]
        )
        box.put(Alert.from_anomaly("run-7", DETAIL))
        assert box.deliver() == 1
    finally:
        controller.stop()
    assert messages[0].rcpt_tos == ["oncall@localhost"]
    assert b"straggler in run-7" in messages[0].content


def test_endpoint_down_for_a_while_loses_nothing(tmp_path, sink, caplog):
    clock = Clock()
    url = f"http://127.0.0.1:{sink.port}/secret-token-xyz"
    box = Outbox(tmp_path, [SlackWebhook(url)], OutboxConfig(backoff_s=2), clock=clock)
    box.put(Alert.from_anomaly("run-7", DETAIL))
    with caplog.at_level(logging.WARNING):
        assert box.deliver() == 0  # nobody listening
        clock.t += 1
        assert box.deliver() == 0  # not due yet: backoff
    assert len(box.pending()) == 1
    assert "secret-token-xyz" not in caplog.text  # the webhook URL is a secret
    # a new process picks up the same outbox once the endpoint is back
    sink.start()
    clock.t += 10
    again = Outbox(tmp_path, [SlackWebhook(url)], OutboxConfig(backoff_s=2), clock=clock)
    assert again.deliver() == 1 and again.pending() == []
    assert len(sink.received) == 1


def test_duplicates_are_sent_once_and_the_rate_limit_defers(tmp_path, sink):
    sink.start()
    clock = Clock()
    box = Outbox(
        tmp_path, [SlackWebhook(f"http://127.0.0.1:{sink.port}/")], OutboxConfig(per_minute=2), clock=clock
    )
    box.put(Alert.from_anomaly("r", DETAIL))
    box.deliver()
    box.put(Alert.from_anomaly("r", DETAIL))  # the same episode again
    for step in (60, 70, 80):
        box.put(Alert.from_anomaly("r", {**DETAIL, "start_step": step}))
    assert box.deliver() == 1  # 2 per minute: one slot left
    clock.t += 61
    assert box.deliver() == 2
    assert len(sink.received) == 4 and box.pending() == []


def test_secrets_come_from_files_or_environment(tmp_path):
    f = tmp_path / "webhook"
    f.write_text("https://hooks.example/abc\n")
    assert read_secret(file=f) == "https://hooks.example/abc"
    assert read_secret(env="HOOK", environ={"HOOK": "x"}) == "x"
    assert read_secret(env="HOOK", environ={}) is None
    assert "abc" not in repr(SlackWebhook("https://hooks.example/abc"))
