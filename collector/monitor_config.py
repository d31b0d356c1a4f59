"""How a Monitor records, said once: `MonitorSettings` are the knobs a user sets (the run's
`[monitor]` TOML section, `--set monitor.X=...`, or keywords of `Monitor.from_env`);
`MonitorConfig` adds where this one Monitor writes, built at the edge and handed down."""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

from meshscope.collector.exporter import valid_host

LOOPBACK = "127.0.0.1"
# a step timed in full costs the host's training thread ~50 us more (hooks, callbacks, marks):
# one in 10 saves most of it (`benchmarks/overhead.py --set detail_every=1`)
HOST_DETAIL_EVERY = 10


class MonitorSettings(BaseModel):
    """What a Monitor measures, how often, and where it serves /metrics."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    metrics_port: int | None = Field(
        9400,
        gt=0,
        lt=65536,
        description="base port of /metrics: rank r serves on base + local rank (none: no exporter)",
    )
    metrics_host: str = Field(
        "",
        description="address /metrics listens on and targets.json names: empty = 127.0.0.1 "
        "(`meshscope run` on several nodes: the address on the route to the rendezvous host)",
    )
    metrics_labels: bool = Field(
        False,
        validation_alias=AliasChoices("metrics_labels", "topology_labels"),
        description="stamp job, run, rank and node on every series (for a Kubernetes PodMonitor "
        "with honorLabels: true, which finds pods rather than reading targets.json)",
    )
    expert_every: int = Field(
        5,
        gt=0,
        le=10**6,
        description="steps per expert-load window, summed over ranks in one small all-reduce (an "
        "expert alarm can come up to N-1 steps after the fault; on the host, where nothing in the "
        "loop listens, the service thread sums about 2 s of windows at once: up to ~2 s more)",
    )
    sync_every: int = Field(
        10,
        gt=0,
        le=10**6,
        description="steps per window: a window's device scalars share one buffer and one copy "
        "to the host, and a step is recorded once its window's copy landed",
    )
    comm_sample_every: int = Field(
        10,
        gt=0,
        le=10**6,
        description="time gradient buckets on one step in N (the wait for communication, which "
        "makes the comm ratio, is measured on every timed step: `detail_every`)",
    )
    detail_every: int | None = Field(
        None,
        gt=0,
        le=10**6,
        description="time a step's phases and its wait for communication on one step in N; the "
        "steps between record step time, tokens, logged scalars and bytes, with phases NaN. "
        "None: every step on a device (events are cheap) and in meshscope's trainer (its "
        f"detectors judge phases), one step in {HOST_DETAIL_EVERY} in your own loop on the host "
        "(a timed step costs the host's training thread ~50 us more)",
    )
    memory_every: int | None = Field(
        None,
        gt=0,
        le=10**6,
        description="read memory (host RSS, device allocated and reserved) on one step in N; the "
        "steps between carry the last reading. None: on the timed steps (`detail_every`); an RSS "
        "read costs ~12 us a step on a busy host",
    )
    drain_interval_s: float = Field(
        1.0,
        gt=0,
        le=60,
        description="how often the Monitor's service thread writes the flight log's step ends: "
        "the records of DDP's reduction each step completed and the typical step time the hang "
        "watchdog scales its patience by (a step's progress itself is written as it ends). At "
        "record_every_s (the default) each wake-up is one round: 0.5 costs that thread ~25 % "
        "more at d_model 256, a round wakes it cold",
    )
    record_every_s: float = Field(
        1.0,
        gt=0,
        le=600,
        description="how often the service thread turns finished steps into records, gauges and "
        "store rows, a batch at a time (a round's fixed part, cold after the step's compute, is "
        "paid once a batch: 1 s costs that thread ~15 % less than 0.5 s at d_model 64 and ~10 % "
        "at 256); flush() and close() do it at once. Alerts wait for it: a 1 s scrape paged a 4x "
        "straggler 5.2 s after it began at 0.2 s, 6.4 s at 0.5 s and at 1 s "
        "(`benchmarks/alert_latency.py`)",
    )
    flight_log: bool = Field(
        True,
        description="keep the collective flight log in <run>/live/, which the hang watchdog reads "
        "(DDP's C++ all-reduce is one record a step; a Python comm hook's buckets one each)",
    )
    flight_capacity: int = Field(
        2048, ge=16, le=1 << 20, description="collectives the flight log keeps per rank (a ring)"
    )

    @field_validator("metrics_host")
    @classmethod
    def _host(cls, value: str) -> str:
        if value and not valid_host(value):
            raise ValueError(f"{value!r} is not an IP address or host name")
        return value

    def detail_period(self, on_device: bool) -> int:
        """Steps between fully timed steps: `detail_every`, or its default for where the
        Monitor runs (see the field)."""
        if self.detail_every is not None:
            return self.detail_every
        return 1 if on_device else HOST_DETAIL_EVERY

    @property
    def metrics_address(self) -> str:
        """Where /metrics listens: `metrics_host`, loopback when unset."""
        return self.metrics_host or LOOPBACK


class MonitorConfig(MonitorSettings):
    """One Monitor's settings and where it writes; built once at the edge and handed down."""

    run_dir: Path = Field(description="folder of this run: store.sqlite and targets.json live here")
    run_id: str = Field("", description="run identifier; defaults to the run directory's name")
    nan_events: bool = Field(
        True,
        description="write a `nan` event when the logged loss turns non-finite; off when a tensor "
        "tracer reports non-finite steps itself (with the module): one event per finding",
    )

    def model_post_init(self, _context: object) -> None:
        """The run id defaults to the run directory's name."""
        if not self.run_id:
            self.run_id = self.run_dir.name
