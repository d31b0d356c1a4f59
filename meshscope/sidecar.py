"""What runs beside training on each agent: the detection engine, the hang watchdog, the alert
outbox, the detector's /metrics endpoint and the abort policy. The CLI builds one `Sidecar`
per `meshscope run` and stops it when torchrun returns; nothing here trains."""

from __future__ import annotations

import logging
import os
import signal
import socket
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode

from meshscope.alerting import AlertPath
from meshscope.alerts.notify import Alert, Outbox, parse_host_port
from meshscope.collector.exporter import DETECTOR_JOB, PortInUseError, serve_metrics, write_detector_target
from meshscope.collector.relay import StoreRelay
from meshscope.collector.rundir import OUTBOX, LeaderLock, job_leader, live_dir
from meshscope.collector.schema import Event, anomaly_link
from meshscope.collector.store import RELAY_TABLES, RunStore, store_path
from meshscope.collector.storedb import locate
from meshscope.collector.timeaccount import TimeAccountCollector
from meshscope.detectors.episodes import Episode
from meshscope.detectors.live import LiveDetection
from meshscope.feedback.rebalance import Rebalancer
from meshscope.watchdog.exchange import NodeExchange
from meshscope.watchdog.verdicts import Diagnosis
from meshscope.watchdog.watch import HangWatch, pid_alive

log = logging.getLogger("meshscope.sidecar")


def hang_exchange(cfg: Any) -> NodeExchange | None:
    """With several agents, the watchdogs share flight logs through the rendezvous store."""
    if not cfg.elastic.rdzv_endpoint:
        return None
    import torch.distributed as dist

    host, port = parse_host_port(cfg.elastic.rdzv_endpoint, "--rdzv-endpoint")

    def connect() -> Any:
        # TCPStore's client retries a store that is not up yet for its whole timeout and logs
        # each failure with C++ frames: a plain connect says "not yet" at once, and quietly
        with socket.create_connection((host, port), timeout=2):
            pass
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5))

    return NodeExchange(connect, prefix=f"job/{cfg.job_id}/hang")  # scoped like every key of the job


def view_link(view_url: str | None, run_id: str, **params: Any) -> str:
    """The drill-down view's deep link for an alert ('' without a view): the anomaly is not
    stored yet when its alert goes out, so the link names it by type and step."""
    if not view_url:
        return ""
    query = urlencode({"run": run_id, **{k: v for k, v in params.items() if v is not None}})
    return f"{view_url.rstrip('/')}/?{query}"


class Sidecar:
    """The engine and the watchdog beside one agent's workers, exporting on the port after the
    ranks'. `start()` returns self; `stop()` returns the closed anomaly episodes."""

    def __init__(self, cfg: Any, alerts: AlertPath) -> None:
        self.cfg = cfg
        self.outbox = (
            Outbox(cfg.run_dir / OUTBOX, alerts.channels, cfg.alerts.outbox) if alerts.channels else None
        )
        # this node's watchdog watches its own ranks (and answers the others'); one node judges the job
        node_lock = LeaderLock(cfg.run_dir)
        self.job_lock = job_leader(cfg.run_dir, node_lock)
        target = locate(cfg.run_dir)
        self.relay = (
            StoreRelay(store_path(cfg.run_dir), target, RELAY_TABLES, active=node_lock.held)
            if target.is_postgres
            else None
        )
        rounds = [self.outbox.deliver] if self.outbox else []
        if cfg.parallel.replace_threshold:  # live expert re-placement, decided where the job is judged
            rebalancer = Rebalancer(
                cfg.run_dir,
                cfg.parallel.ep,
                cfg.parallel.replace_threshold,
                cfg.parallel.replace_cooldown,
                run_id=cfg.run_id,
            )
            rounds.append(rebalancer.round)
        self.live = LiveDetection(
            cfg.run_dir,
            cfg.run_id,
            config=cfg.detect,
            on_open=[self._alert_anomaly] if self.outbox else [],
            on_round=rounds,
            leader=self.job_lock,
        )
        # where the job's time went, as counters on the detector's /metrics (the judge's only)
        self.live.registry.register(TimeAccountCollector(cfg.run_dir, leader=self.job_lock))
        self.watch = HangWatch(
            live_dir(cfg.run_dir),
            cfg.hang,
            on_hang=self._hung,
            leader=node_lock.held,
            exchange=hang_exchange(cfg),
            judge=self.job_lock.held,
        )
        self.metrics_url: str | None = None
        self.export_error: str | None = None
        self._metrics_server: Any = None  # the detector's /metrics, shut at `close`

    def start(self) -> Sidecar:
        """Export the detector's metrics (a busy port degrades with a reason) and start judging."""
        port = self.cfg.monitor.metrics_port + self.cfg.nproc
        try:
            host = self.cfg.monitor.metrics_address
            node = socket.gethostname()
            labels = (
                {"job": DETECTOR_JOB, "run": self.cfg.run_id, "node": node}
                if self.cfg.monitor.metrics_labels
                else None
            )
            self._metrics_server, _ = serve_metrics(self.live.registry, port, host=host, labels=labels)
            write_detector_target(self.cfg.run_dir, run_id=self.cfg.run_id, host=host, port=port, node=node)
            self.metrics_url = f"http://{host}:{port}/metrics"
        except PortInUseError as err:
            self.export_error = str(err)
        if self.relay is not None:
            self.relay.start()
        self.live.start()
        self.watch.start()
        return self

    def stop(self) -> list[Episode]:
        """Stop watching, judge what is left; the closed episodes of the whole run."""
        if self.relay is not None:
            self.relay.drain()  # this node's last steps reach the job store before the last judging
        self.watch.stop()
        return self.live.stop()

    def close(self, retry_s: float = 30.0) -> None:
        """Ship what the end of the run wrote (anomalies, run_end) to the job store, and stop
        serving the detector's metrics (its port is free again)."""
        if self.relay is not None:
            self.relay.close_retry_s = retry_s
            self.relay.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None

    def _link(self, **params: Any) -> str:
        return view_link(self.cfg.alerts.view_url, self.cfg.run_id, **params)

    def _alert_anomaly(self, ep: Episode) -> None:
        """Alert as soon as an anomaly is confirmed; the event follows when it ends."""
        detail = ep.detail()
        self.outbox.put(Alert.from_anomaly(self.cfg.run_id, detail, self._link(**anomaly_link(detail))))

    def _hung(self, diag: Diagnosis) -> None:
        """A hang or broken collective: metric and (abort) end this node's workers so the elastic
        agent restarts them from the last checkpoint; the job's leader also records the event
        and alerts (every node's watchdog sees the stall: the job hears of it once)."""
        self.live.metrics.faults.labels(kind="hang").inc()
        detail = {**diag.detail(), "action": self.cfg.hang.on_hang}
        if self.job_lock.held():
            self._record_hang(diag, detail)
        if self.cfg.hang.on_hang == "abort":
            kill_all(diag.pids.values())
        log.warning("hang: %s", diag.why)

    def _record_hang(self, diag: Diagnosis, detail: dict[str, Any]) -> None:
        """The hang event in the store, and its alert."""
        store = RunStore(self.cfg.run_dir)  # this thread's own connection (SQLite is per thread)
        try:
            step = diag.step
            store.add_event(
                Event(kind="hang", run_id=self.cfg.run_id, severity="critical", step=step, detail=detail)
            )
        finally:
            store.close()
        if self.outbox is not None:
            self.outbox.put(
                Alert.from_hang(
                    self.cfg.run_id, detail, self._link(alert="HangDetected", step=detail.get("step"))
                )
            )
            self.outbox.deliver()


def kill_all(pids: Any) -> None:
    """SIGKILL the live workers among `pids` (the abort policy: torchrun then restarts them)."""
    for pid in pids:
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
