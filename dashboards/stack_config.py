"""The stack's settings, apart from the stack: the `[stack]` section of the run's one config,
which `meshscope stack up --config` and `meshscope run` (to find the stack) both read, without
importing what starting servers needs."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

STACK_HOME = Path(".meshscope/stack")


class StackSettings(BaseModel):
    """Where `meshscope stack` keeps its state, its ports, and what it starts."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    home: Path = Field(STACK_HOME, description="folder for the stack's configs, data, logs and pid files")
    prometheus_port: int = Field(9090, gt=0, lt=65536, description="Prometheus port")
    alertmanager_port: int = Field(9093, gt=0, lt=65536, description="Alertmanager port")
    scrape_interval_s: float = Field(
        5.0, gt=0, le=3600, description="scrape and rule evaluation interval, seconds"
    )
    fast: bool = Field(False, description="1 s alert grouping waits, fresh samples at once (tests)")
    remote_write: bool = Field(False, description="also VictoriaMetrics (Prometheus remote-writes to it)")
    victoria_port: int = Field(8428, gt=0, lt=65536, description="VictoriaMetrics port (with remote_write)")
    job_store: bool = Field(False, description="also a PostgreSQL job store (runs write it with --store)")
    job_store_port: int = Field(5433, gt=0, lt=65536, description="PostgreSQL port (with job_store)")
    job_store_host: str = Field(
        "",
        description="address the job store listens on and runs are given (default: this node's "
        "address on its default route, which the other nodes reach; 127.0.0.1 keeps it here)",
    )
    job_store_allow: str = Field(
        "",
        description="networks (CIDR, comma-separated) whose nodes may log in with the password "
        "(default: the network of the default route's interface)",
    )
    job_store_tls: str = Field(
        "", description="CERT,KEY: the job store serves TLS with them; other nodes log in over TLS only"
    )
