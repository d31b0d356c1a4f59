"""The per-rank /metrics endpoint and the Prometheus file_sd targets of a run."""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import json
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, disable_created_metrics, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector


class PortInUseError(RuntimeError):
    """A metrics port is taken; the message says which and how to choose another."""


def port_for(base_port: int, local_rank: int) -> int:
    """The /metrics port of a local rank."""
    return base_port + local_rank


_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?$")


def valid_host(host: str) -> bool:
    """Whether `host` is an IP address or a DNS name a socket can take (ASCII labels): checked
    where the user gives one, so a typo is a message, not an encoding error at bind time."""
    try:
        ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
        return True
    except ValueError:
        return bool(_HOSTNAME.match(host))


def split_host_port(value: str) -> tuple[str, int] | None:
    """`host:port` -> (host, port) with a host `valid_host` takes and a port 1-65535; None
    otherwise (each caller names its own flag or field in the error)."""
    host, sep, port = value.rpartition(":")
    if not sep or not valid_host(host) or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def ensure_ports_free(host: str, ports: list[int]) -> None:
    """Raise PortInUseError naming the first busy port (checked before launching workers)."""
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError as err:
                if isinstance(err, socket.gaierror) or err.errno == errno.EADDRNOTAVAIL:
                    raise PortInUseError(
                        f"metrics_host {host!r}: not an address of this machine ({err.strerror}); "
                        "set metrics_host (--set monitor.metrics_host=ADDR) to one, or leave it empty"
                    ) from None
                raise PortInUseError(
                    f"metrics port {port} on {host} is already in use ({err.strerror}); "
                    f"choose another base with --metrics-port"
                ) from None


class Stamped(Collector):
    """A registry's series with the target's topology labels on every sample: for scrapers
    that find pods rather than read targets.json (a Kubernetes PodMonitor with honorLabels),
    so the rules and boards see the same `job`, `run`, `rank` and `node` either way."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry, self.labels = registry, labels

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            stamped = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                stamped.add_sample(s.name, {**s.labels, **self.labels}, s.value, s.timestamp, s.exemplar)
            yield stamped


def serve_metrics(
    registry: CollectorRegistry, port: int, host: str = "127.0.0.1", labels: dict[str, str] | None = None
):
    """Start the HTTP exporter; returns (server, thread). A busy port is a clear error.
    `labels`: topology stamped on every series (see `Stamped`)."""
    disable_created_metrics()  # *_created series double the series count and nothing reads them
    if labels:
        served = CollectorRegistry(auto_describe=False)
        served.register(Stamped(registry, labels))
        registry = served
    try:
        return start_http_server(port, addr=host, registry=registry)
    except OSError as err:
        if err.errno in (errno.EADDRINUSE, errno.EACCES):
            raise PortInUseError(
                f"metrics port {port} on {host} is already in use; choose another base with --metrics-port"
            ) from None
        raise


TARGETS_INDEX = "_targets"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # Prometheus never reads half a file


RANK_JOB, DETECTOR_JOB = "meshscope", "meshscope_detector"


def write_targets(run_dir: Path, *, run_id: str, host: str, ports_by_rank: dict[int, int], node: str) -> Path:
    """Write `<run_dir>/targets.json` (file_sd), and the same into `<runs root>/_targets/<run_id>.json`.

    The copy exists because file_sd globs only the last path segment: one pattern,
    `<runs root>/_targets/*.json`, then finds every run.
    """
    return _merge_targets(
        run_dir,
        run_id,
        [
            {
                "targets": [f"{host}:{port}"],
                "labels": {"job": RANK_JOB, "run": run_id, "rank": str(rank), "node": node},
            }
            for rank, port in sorted(ports_by_rank.items())
        ],
    )


def write_detector_target(run_dir: Path, *, run_id: str, host: str, port: int, node: str) -> Path:
    """Add the detection engine's endpoint (job `meshscope_detector`, no rank) to the run's targets."""
    return _merge_targets(
        run_dir,
        run_id,
        [{"targets": [f"{host}:{port}"], "labels": {"job": DETECTOR_JOB, "run": run_id, "node": node}}],
    )


def _index_file(run_dir: Path, run_id: str) -> Path:
    """The run's copy in `<runs root>/_targets/`, the folder Prometheus' file_sd globs."""
    return Path(run_dir).resolve().parent / TARGETS_INDEX / f"{run_id}.json"


def remove_from_index(run_dir: Path, run_id: str) -> None:
    """A run that ended cleanly leaves Prometheus' view (its own targets.json stays, as a record);
    a run that died stays there, so RankDown and RecoveryFailed can fire."""
    _index_file(run_dir, run_id).unlink(missing_ok=True)


def _target_key(group: dict) -> tuple[str, str]:
    """A rank's endpoint is one per rank; a detector's, one per node (each agent runs one)."""
    labels = group["labels"]
    return labels.get("job", RANK_JOB), labels.get("rank") or labels.get("node", "")


def _order(group: dict) -> tuple[str, int, str]:
    labels = group["labels"]
    return labels.get("job", RANK_JOB), int(labels.get("rank", -1)), labels.get("node", "")


def _merge_targets(run_dir: Path, run_id: str, mine: list[dict]) -> Path:
    path = Path(run_dir) / "targets.json"
    replaced = {_target_key(g) for g in mine}
    # Several nodes (and the detector) share a run directory: merge under a lock, keeping the rest.
    with open(path.with_name("targets.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            others = [g for g in json.loads(path.read_text()) if _target_key(g) not in replaced]
        except (OSError, ValueError, KeyError):
            others = []
        groups = sorted(others + mine, key=_order)
        text = json.dumps(groups, indent=2)
        _atomic_write(path, text)
        index = _index_file(run_dir, run_id)
        index.parent.mkdir(exist_ok=True)
        _atomic_write(index, text)
    return path
