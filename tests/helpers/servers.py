"""Real servers from Debian's packages, on 127.0.0.1, for e2e tests."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import requests

from tests.helpers.ports import free_port_range


class Prometheus:
    """`prometheus` on a free port with its own data folder; stopped on exit."""

    def __init__(self, binary: str, config: Path, workdir: Path) -> None:
        self.port = free_port_range(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "prometheus.log"
        self.cmd = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--web.enable-lifecycle",
        ]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Prometheus:
        self.proc = subprocess.Popen(self.cmd, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{self.url}/-/ready", timeout=1).ok:
                    return self
            except requests.RequestException:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.__exit__()
        raise RuntimeError(f"prometheus did not become ready:\n{self.log.read_text()[-2000:]}")

    def query(self, promql: str) -> list[dict]:
        r = requests.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=5)
        r.raise_for_status()
        return r.json()["data"]["result"]

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
