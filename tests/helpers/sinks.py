"""Local stand-ins for Slack and a mail server: a webhook sink and an aiosmtpd mailbox."""

from __future__ import annotations

import json
import threading
import time
from email import message_from_bytes, policy
from http.server import BaseHTTPRequestHandler, HTTPServer

from aiosmtpd.controller import Controller

from tests.helpers.ports import free_port_range


class Sink:
    """A webhook receiver on 127.0.0.1 that can be started late (the endpoint 'comes back').
    `received` holds the JSON bodies, `times` when each arrived (time.time())."""

    def __init__(self):
        self.port = free_port_range(1)
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self.received: list[dict] = []
        self.times: list[float] = []
        self.server = None

    def start(self) -> Sink:
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                sink.received.append(body)
                sink.times.append(time.time())
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = HTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def texts(self) -> list[str]:
        """Slack bodies as one string each (title + text, or the whole JSON)."""
        out = []
        for body in list(self.received):
            parts = [body.get("text", "")] + [
                f"{a.get('title', '')}\n{a.get('text', '')}" for a in body.get("attachments", [])
            ]
            out.append("\n".join(parts))
        return out

    def stop(self) -> None:
        if self.server:
            self.server.shutdown()
            self.server.server_close()


class Mailbox:
    """An SMTP server (aiosmtpd) on 127.0.0.1 keeping every message it is given."""

    def __init__(self):
        self.port = free_port_range(1)
        self.messages: list = []  # email.message.EmailMessage
        self.recipients: list[list[str]] = []
        box = self

        class Handler:
            async def handle_DATA(self, server, session, envelope):
                box.recipients.append(list(envelope.rcpt_tos))
                box.messages.append(message_from_bytes(envelope.content, policy=policy.default))
                return "250 OK"

        self.controller = Controller(Handler(), hostname="127.0.0.1", port=self.port)

    def start(self) -> Mailbox:
        self.controller.start()
        return self

    def bodies(self) -> list[str]:
        out = []
        for msg in list(self.messages):
            part = msg.get_body(preferencelist=("plain", "html"))
            out.append(f"Subject: {msg['Subject']}\n{part.get_content() if part else ''}")
        return out

    def stop(self) -> None:
        self.controller.stop()
