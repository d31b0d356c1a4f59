"""What runs beside one agent's workers starts and stops as one: no thread and no port left."""

from __future__ import annotations

import socket
import threading

from fixtures.ports import free_port_range
from fixtures.runs import TINY


def test_the_sidecar_starts_and_stops_twenty_times_and_leaves_no_thread_or_port(tmp_path):
    from meshscope.alerting import alert_path
    from meshscope.config import load_config
    from meshscope.sidecar import Sidecar

    base = free_port_range(3)
    before = set(threading.enumerate())
    for i in range(20):
        cfg = load_config(TINY, {"runs_root": str(tmp_path), "run_id": f"s{i}", "metrics_port": base})
        cfg.run_dir.mkdir(parents=True)
        sidecar = Sidecar(cfg, alert_path(cfg)).start()
        assert sidecar.metrics_url and sidecar.export_error is None, (
            sidecar.export_error
        )  # the port was free again
        assert sidecar.live.running and sidecar.watch.running
        sidecar.stop()
        sidecar.close()
        assert not sidecar.live.running and not sidecar.watch.running
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not left, left
    with socket.socket() as probe:  # the detector's /metrics port (after the ranks') is free
        probe.bind((cfg.monitor.metrics_address, base + cfg.nproc))
