"""How a Monitor records: its one config, built once at the edge and handed down."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(kw_only=True)
class MonitorConfig:
    """How a Monitor records. Built once at the edge and handed down."""

    run_dir: Path
    """Folder of this run: store.sqlite and targets.json live here."""
    run_id: str = ""
    """Run identifier; defaults to the run directory's name."""
    metrics_port: int | None = 9400
    """Base port of the per-rank /metrics exporter (port = base + local rank); None = no exporter."""
    metrics_host: str = "127.0.0.1"
    """Address the exporter binds to and the one written into targets.json."""
    topology_labels: bool = False
    """Stamp job, run, rank and node on every series /metrics serves, for scrapers that find
    pods rather than read targets.json (a Kubernetes PodMonitor with honorLabels: true)."""
    expert_every: int = 5
    """Sum expert token counts over ranks every this many steps (one small all-reduce)."""
    sync_every: int = 10
    """Steps per window: device scalars of a window share one buffer and one copy to the host
    (the service thread records a step once its window's copy landed)."""
    comm_sample_every: int = 10
    """Time each gradient bucket on one step in this many (the wait for communication, which
    makes the comm ratio, is measured every step)."""
    memory_every: int = 1
    """Read memory (host RSS, device allocated and reserved) on one step in this many; the
    steps between carry the latest reading. Every step by default: a leak is seen where it
    starts; an RSS read costs a step ~30 us on a busy host, which a larger value saves."""
    drain_interval_s: float = 0.2
    """How often the Monitor's service thread turns finished steps into records, gauges and
    store rows (off the training thread)."""
    nan_events: bool = True
    """Write a `nan` event when the logged loss turns non-finite. Off when a tensor tracer
    reports non-finite steps itself (with the module): one event per finding, not two."""
    flight_log: bool = True
    """Keep the collective flight log (`collector.flightlog`) in `<run_dir>/live/`, which the
    hang watchdog reads. DDP keeps its C++ all-reduce: a step's reduction is one record
    (`collector.flightfixed.ReductionRecord`); a Python comm hook's buckets are recorded one by one."""
    flight_capacity: int = 2048
    """Collectives the flight log keeps per rank (a ring)."""

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        if not self.run_id:
            self.run_id = self.run_dir.name
        if self.expert_every < 1:
            raise ValueError(f"MonitorConfig.expert_every must be >= 1, got {self.expert_every}")
        if self.sync_every < 1:
            raise ValueError(f"MonitorConfig.sync_every must be >= 1, got {self.sync_every}")
        if self.comm_sample_every < 1:
            raise ValueError(f"MonitorConfig.comm_sample_every must be >= 1, got {self.comm_sample_every}")
        if self.memory_every < 1:
            raise ValueError(f"MonitorConfig.memory_every must be >= 1, got {self.memory_every}")
        if not 0 < self.drain_interval_s <= 60:
            raise ValueError(
                f"MonitorConfig.drain_interval_s must be in (0, 60], got {self.drain_interval_s}"
            )
        if self.flight_capacity < 16:
            raise ValueError(f"MonitorConfig.flight_capacity must be >= 16, got {self.flight_capacity}")
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            raise ValueError(f"MonitorConfig.metrics_port must be a TCP port, got {self.metrics_port}")
