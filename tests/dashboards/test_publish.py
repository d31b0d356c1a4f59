"""`meshscope dashboards publish` sends the right requests to Grafana's HTTP API.

Grafana cannot run here, so a local HTTP server plays its API: it answers as Grafana does and
records what it was sent."""

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from typer.testing import CliRunner

from fixtures.ports import free_port_range
from meshscope.cli import app
from meshscope.dashboards.boards import build_all

TOKEN = "glsa_secret_token_123"


class FakeGrafana:
    def __init__(self, folder_exists: bool, fail_dashboards: int | None = None):
        self.requests: list[tuple[str, str, dict, dict]] = []  # method, path, headers, body
        self.folder_exists, self.fail_dashboards = folder_exists, fail_dashboards
        self.port = free_port_range(1)
        grafana = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else {}
                grafana.requests.append((self.command, self.path, dict(self.headers), body))
                return body

            def do_GET(self):
                self._record()
                if self.path == "/api/folders/meshscope" and grafana.folder_exists:
                    return self._answer(200, {"uid": "meshscope", "title": "meshscope"})
                self._answer(404, {"message": "folder not found"})

            def do_POST(self):
                body = self._record()
                if self.path == "/api/folders":
                    return self._answer(200, {"uid": body["uid"], "title": body["title"]})
                if self.path == "/api/dashboards/db":
                    if grafana.fail_dashboards:
                        return self._answer(grafana.fail_dashboards, {"message": "Invalid API key"})
                    uid = body["dashboard"]["uid"]
                    return self._answer(
                        200, {"status": "success", "uid": uid, "version": 3, "url": f"/d/{uid}/x"}
                    )
                self._answer(404, {"message": "not found"})

            def log_message(self, *args):
                pass

        self.server = HTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def _publish(grafana, token_file):
    return CliRunner().invoke(
        app,
        [
            "dashboards",
            "publish",
            "--url",
            f"http://127.0.0.1:{grafana.port}",
            "--token-file",
            str(token_file),
        ],
    )


def test_publish_creates_the_folder_then_upserts_every_board(token_file):
    grafana = FakeGrafana(folder_exists=False)
    try:
        result = _publish(grafana, token_file)
    finally:
        grafana.stop()
    assert result.exit_code == 0, result.output
    calls = [(m, p) for m, p, _, _ in grafana.requests]
    assert calls[:2] == [("GET", "/api/folders/meshscope"), ("POST", "/api/folders")]
    assert calls[2:] == [("POST", "/api/dashboards/db")] * 4
    assert all(h.get("Authorization") == f"Bearer {TOKEN}" for _, _, h, _ in grafana.requests)
    sent = {b["dashboard"]["uid"]: b for _, p, _, b in grafana.requests if p == "/api/dashboards/db"}
    assert set(sent) == {b["uid"] for b in build_all().values()}
    for body in sent.values():
        assert body["overwrite"] is True and body["folderUid"] == "meshscope"
        assert body["dashboard"]["id"] is None and body["dashboard"]["panels"]
    assert "/d/meshscope-experts/x" in result.output and TOKEN not in result.output


def test_an_existing_folder_is_not_created_again(token_file):
    grafana = FakeGrafana(folder_exists=True)
    try:
        assert _publish(grafana, token_file).exit_code == 0
    finally:
        grafana.stop()
    assert ("POST", "/api/folders") not in [(m, p) for m, p, _, _ in grafana.requests]


def test_a_refusal_is_one_clear_line_without_the_token(token_file):
    grafana = FakeGrafana(folder_exists=True, fail_dashboards=401)
    try:
        result = _publish(grafana, token_file)
    finally:
        grafana.stop()
    assert result.exit_code == 1
    assert "answered 401" in result.output and "Invalid API key" in result.output
    assert TOKEN not in result.output and "Traceback" not in result.output


def test_a_missing_token_file_names_the_option(tmp_path):
    result = CliRunner().invoke(
        app, ["dashboards", "publish", "--url", "http://127.0.0.1:1", "--token-file", str(tmp_path / "nope")]
    )
    assert result.exit_code == 1 and "--token-file" in result.output
