"""A metrics port taken after the launcher checked it: the rank fails naming the port, and
neither the hang watchdog nor `meshscope run` calls that a dead rank."""

from __future__ import annotations

import socket

import pytest
from prometheus_client import CollectorRegistry

from meshscope.collector import DistEnv, Monitor, MonitorConfig
from meshscope.collector.exporter import PortInUseError
from meshscope.collector.flightread import latest_logs
from meshscope.watchdog.watch import diagnose_folder


def test_a_port_taken_since_the_check_is_named_and_is_no_hang(tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    env = DistEnv(rank=1, world_size=1, local_rank=0, local_world_size=1)
    try:
        with pytest.raises(PortInUseError, match=str(port)):
            Monitor(MonitorConfig(run_dir=tmp_path, metrics_port=port), env=env, registry=CollectorRegistry())
    finally:
        holder.close()
    head = latest_logs(tmp_path / "live")[1]
    assert head.closed and str(port) in head.last_error, head
    diag = diagnose_folder(tmp_path / "live")
    assert diag.kind.value != "stuck" and "died" not in diag.why, diag.why
    assert str(port) in diag.why or str(port) in str(diag.detail()), diag.detail()
