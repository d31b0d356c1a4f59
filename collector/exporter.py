"""The per-rank /metrics endpoint and the Prometheus file_sd targets of a run."""
from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path

from prometheus_client import CollectorRegistry, disable_created_metrics, start_http_server


class PortInUseError(RuntimeError):
    """A metrics port is taken; the message says which and how to choose another."""


def port_for(base_port: int, local_rank: int) -> int:
    return base_port + local_rank


def ensure_ports_free(host: str, ports: list[int]) -> None:
    """Raise PortInUseError naming the first busy port (checked before launching workers)."""
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError as err:
                raise PortInUseError(
                    f"metrics port {port} on {host} is already in use ({err.strerror}); "
                    f"choose another base with --metrics-port") from None


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1"):
    """Start the HTTP exporter; returns (server, thread). A busy port is a clear error."""
    disable_created_metrics()  # *_created series double the series count and nothing reads them
    try:
        return start_http_server(port, addr=host, registry=registry)
    except OSError as err:
        if err.errno in (errno.EADDRINUSE, errno.EACCES):
            raise PortInUseError(
                f"metrics port {port} on {host} is already in use; "
                f"choose another base with --metrics-port") from None
        raise


def write_targets(run_dir: Path, *, run_id: str, host: str, ports_by_rank: dict[int, int],
                  node: str) -> Path:
    """Write `<run_dir>/targets.json` (file_sd) atomically: Prometheus never reads half a file."""
    groups = [
        {"targets": [f"{host}:{port}"],
         "labels": {"job": "meshscope", "run": run_id, "rank": str(rank), "node": node}}
        for rank, port in sorted(ports_by_rank.items())
    ]
    path = Path(run_dir) / "targets.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(groups, indent=2))
    os.replace(tmp, path)
    return path
