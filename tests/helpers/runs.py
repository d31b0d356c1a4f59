"""Start `meshscope run` as a person would, in a subprocess, and scrape it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.ports import free_port_range

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "tests" / "data" / "tiny.toml"
MESHSCOPE = [sys.executable, "-m", "meshscope"]


def start_run(
    runs_root: Path,
    run_id: str,
    port: int | None,
    *extra: str,
    config: Path = TINY,
    new_session: bool = False,
) -> subprocess.Popen:
    """`meshscope run` in a subprocess (stdout and stderr together, as text). `port`: the
    metrics base port (None: free ones); `new_session`: its own process group, for tests that
    kill the whole tree."""
    cmd = [
        *MESHSCOPE,
        "run",
        "--config",
        str(config),
        "--run-dir",
        str(runs_root),
        "--run-id",
        run_id,
        "--metrics-port",
        str(port if port is not None else free_port_range(3)),
        *extra,
    ]
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=new_session,
    )


def meshscope(*args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess:
    """Any other `meshscope` command, run to its end as a person would (text output)."""
    return subprocess.run(
        [*MESHSCOPE, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, check=check
    )


def scrape(port: int) -> dict[str, object] | None:
    """Families of one /metrics endpoint by name, or None while it is not up."""
    try:
        body = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except requests.RequestException:
        return None
    return {f.name: f for f in text_string_to_metric_families(body)}


def sample(families: dict, family: str, suffix: str = "", **labels: str) -> float | None:
    fam = families.get(family)
    for s in fam.samples if fam else []:
        if s.name == family + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return None


def wait_for(predicate, timeout: float, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None
