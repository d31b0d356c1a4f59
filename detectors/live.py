"""The engine beside a training run: tails the store, writes anomaly events, exports scores."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from prometheus_client import CollectorRegistry

from collector.metrics import DetectorMetrics
from collector.schema import Event
from collector.store import RunStore, load_events, load_expert_load, load_grad_stats, load_steps
from detectors.engine import DetectionEngine, EngineConfig
from detectors.episodes import Episode
from detectors.hang import Diagnosis, HangConfig, HangWatch, NodeExchange, pid_alive
from detectors.notify import Alert, Outbox

log = logging.getLogger("meshscope.detect")


def run_top_k(run_dir: Path) -> int | None:
    """Experts per token of the run's model, from its config.json (None for a user's own
    loop: the engine then reads it from the counts)."""
    try:
        return max(1, int(json.loads((Path(run_dir) / "config.json").read_text())["model"]["top_k"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def episode_key(detail: dict) -> tuple:
    """What makes two anomaly events the same episode: judging a run twice writes it once."""
    return (
        detail.get("type"),
        detail.get("start_step"),
        detail.get("end_step"),
        tuple(detail.get("ranks") or ()),
        detail.get("layer"),
        detail.get("expert"),
        detail.get("module"),
    )


class LiveDetection:
    """Polls `<run>/store.sqlite` every `poll_s`; anomalies become events when they close, and
    count in `meshscope_anomalies_total{type}` when they open."""

    def __init__(
        self,
        run_dir: Path,
        run_id: str,
        config: EngineConfig | None = None,
        registry: CollectorRegistry | None = None,
        poll_s: float = 1.0,
        outbox: Outbox | None = None,
        hang: HangConfig | None = None,
        exchange: NodeExchange | None = None,
        view_url: str | None = None,
    ) -> None:
        self.run_dir, self.run_id, self.poll_s = Path(run_dir), run_id, poll_s
        self.view_url = view_url.rstrip("/") if view_url else None
        self.registry = registry or CollectorRegistry()
        self.metrics = DetectorMetrics(self.registry)
        self.store: RunStore | None = None
        self.engine = DetectionEngine(
            config,
            on_open=self._opened,
            on_close=self._closed,
            on_score=self._score,
            top_k=run_top_k(self.run_dir),
        )
        self.closed: list[Episode] = []
        self.outbox = outbox
        self._written: set[tuple] | None = None  # anomaly events already in the store
        self._lock = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="meshscope-detect", daemon=True)
        # the moment rule: judges the present, so it sees a hang in progress
        self.hang = (
            HangWatch(self.run_dir / "live", hang, on_hang=self._hung, leader=self._leader, exchange=exchange)
            if hang is not None
            else None
        )

    def start(self) -> LiveDetection:
        self._thread.start()
        if self.hang is not None:
            self.hang.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def _leader(self) -> bool:
        """Agents sharing a run directory judge it once: the holder of `detect.lock` does. The
        lock dies with its process, so a surviving agent takes over."""
        if self._lock is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            lock = open(self.run_dir / "detect.lock", "w")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                lock.close()
                return False
            self._lock = lock
        return True

    def poll(self) -> None:
        """One round of judging. Detection never takes training down: errors are logged."""
        if not self._leader():
            return
        try:
            steps = load_steps(self.run_dir, since_step=self.engine.last_step)
            experts = load_expert_load(self.run_dir, since_step=self.engine.last_expert_step)
            grads = load_grad_stats(self.run_dir, since_step=self.engine.last_grad_step)
            self.engine.process(steps, experts, grads)
            if self.outbox is not None:
                self.outbox.deliver()
        except FileNotFoundError:
            return
        except Exception:
            log.exception("detection round failed; training goes on")

    def stop(self) -> list[Episode]:
        """Judge what is left, close every episode, and return all closed episodes."""
        self._stop.set()
        if self.hang is not None:
            self.hang.stop()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.poll()
        if self._lock is not None:
            self.engine.finish()
        if self.store is not None:
            self.store.close()
        return self.closed

    def _opened(self, ep: Episode) -> None:
        """Alert as soon as an anomaly is confirmed; the event follows when it ends."""
        self.metrics.anomalies.labels(type=ep.type).inc()
        if self.outbox is not None:
            self.outbox.put(
                Alert.from_anomaly(
                    self.run_id,
                    ep.detail(),
                    self._link(
                        type=ep.type,
                        start=ep.start_step,
                        rank=ep.ranks[0] if len(ep.ranks) == 1 else None,
                        layer=ep.layer,
                    ),
                )
            )

    def _closed(self, ep: Episode) -> None:
        self.closed.append(ep)
        key = episode_key(ep.detail())
        if key in self._already_written():  # judged before (detect --run again, a new leader)
            return
        if self.store is None:
            self.store = RunStore(self.run_dir)
        self.store.add_event(
            Event(
                kind="anomaly", run_id=self.run_id, severity="warning", step=ep.start_step, detail=ep.detail()
            )
        )
        self._written.add(key)

    def _already_written(self) -> set[tuple]:
        if self._written is None:
            try:
                details = load_events(self.run_dir, kind="anomaly")["detail"]
            except FileNotFoundError:
                details = []
            self._written = {episode_key(d) for d in details}
        return self._written

    def _hung(self, diag: Diagnosis) -> None:
        """A hang or broken collective: event, metric, alert, and (abort) end the workers so
        the elastic agent restarts them from the last checkpoint."""
        self.metrics.faults.labels(kind="hang").inc()
        detail = diag.detail()
        detail["action"] = self.hang.config.on_hang
        store = RunStore(self.run_dir)  # this thread's own connection (SQLite is per thread)
        try:
            store.add_event(
                Event(
                    kind="hang",
                    run_id=self.run_id,
                    severity="critical",
                    step=diag.evidence.get("step"),
                    detail=detail,
                )
            )
        finally:
            store.close()
        if self.outbox is not None:
            self.outbox.put(
                Alert.from_hang(
                    self.run_id, detail, self._link(alert="HangDetected", step=detail.get("step"))
                )
            )
            self.outbox.deliver()
        if self.hang.config.on_hang == "abort":
            for pid in diag.evidence.get("pids", {}).values():
                if pid_alive(pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
        log.warning("hang: %s", diag.why)

    def _link(self, **params: Any) -> str:
        """The drill-down view's deep link for an alert ('' without a view): the anomaly is
        not stored yet when its alert goes out, so the link names it by type and step."""
        if not self.view_url:
            return ""
        query = urlencode({"run": self.run_id, **{k: v for k, v in params.items() if v is not None}})
        return f"{self.view_url}/?{query}"

    def _score(self, detector: str, score: float) -> None:
        self.metrics.anomaly_score.labels(detector=detector).set(score)
