"""The engine beside a training run: tails the store, writes anomaly events, exports scores.

It judges StepRecords only. What else runs beside training (the hang watchdog, the alert
outbox) is wired by the composition root through the callbacks: `on_open` receives each
episode as it opens, `on_round` runs after every round of judging."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from meshscope.collector.env import HostShare
from meshscope.collector.metrics import DetectorMetrics
from meshscope.collector.report import busiest_host
from meshscope.collector.rundir import job_leader, run_info
from meshscope.collector.schema import Event, anomaly_key
from meshscope.collector.service import Service
from meshscope.collector.store import (
    RunStore,
    StoreUnavailable,
    load_events,
    load_expert_load,
    load_grad_stats,
    load_steps,
)
from meshscope.detectors.engine import DetectionEngine, EngineConfig
from meshscope.detectors.episodes import Episode
from meshscope.detectors.pauses import known_pauses

log = logging.getLogger("meshscope.detect")


class LiveDetection(Service):
    """Polls `<run>/store.sqlite` every `poll_s`; anomalies become events when they close, and
    count in `meshscope_anomalies_total{type}` when they open."""

    def __init__(
        self,
        run_dir: Path,
        run_id: str,
        config: EngineConfig | None = None,
        registry: CollectorRegistry | None = None,
        poll_s: float = 1.0,
        on_open: Sequence[Callable[[Episode], None]] = (),
        on_round: Sequence[Callable[[], None]] = (),
        leader: Any = None,
    ) -> None:
        self.run_dir, self.run_id, self.poll_s = Path(run_dir), run_id, poll_s
        self.leader = leader or job_leader(self.run_dir)  # held(): this process judges the job
        self._own_leader = leader is None  # taken here: given up at stop (a given one is shared)
        self.on_open, self.on_round = list(on_open), list(on_round)
        self.store: RunStore | None = None
        self.engine = DetectionEngine(
            config,
            on_open=self._opened,
            on_close=self._closed,
            on_score=self._score,
            top_k=run_info(self.run_dir).top_k,
        )
        self.registry = registry or CollectorRegistry()
        self.metrics = DetectorMetrics(self.registry, anomaly_types=self.engine.anomaly_types)
        self.closed: list[Episode] = []
        self.host: HostShare | None = None
        self._host_known = False
        self._written: set[tuple] | None = None  # anomaly events already in the store
        super().__init__("meshscope-detect", poll_s, join_s=30)

    def round(self) -> None:
        """One round of judging (see `poll`)."""
        self.poll()

    def poll(self) -> None:
        """One round of judging. Detection never takes training down: errors are logged."""
        if not self.leader.held():
            return
        try:
            self._learn_host()
            # before the steps: a checkpoint's event is stored before the step it slows
            self.engine.pause(known_pauses(load_events(self.run_dir)))
            steps = load_steps(self.run_dir, since_step=self.engine.last_step)
            experts = load_expert_load(self.run_dir, since_step=self.engine.last_expert_step)
            grads = load_grad_stats(self.run_dir, since_step=self.engine.last_grad_step)
            self.engine.process(steps, experts, grads)
            for callback in self.on_round:
                callback()
        except FileNotFoundError:
            return
        except StoreUnavailable as err:  # the relay says the outage once; judge again when it ends
            log.debug("detection waits for the job store: %s", err)
        except Exception:
            log.exception("detection round failed; training goes on")

    def _learn_host(self) -> None:
        """The most shared node's `host` event, until one is read (each node writes one when it
        starts); the engine then judges stragglers against it."""
        if self._host_known:
            return
        self.host = busiest_host(load_events(self.run_dir, kind="host"))
        if self.host is not None:
            self.engine.judge_against(self.host)
            self._host_known = True

    def stop(self) -> list[Episode]:
        """Judge what is left, close every episode, and return all closed episodes."""
        super().stop()
        self.poll()
        if self.leader.held():
            self.engine.finish()
        if self.store is not None:
            self.store.close()
        if self._own_leader:  # a later judge in this process (detect --run again) may take it
            self.leader.release()
        return self.closed

    def _opened(self, ep: Episode) -> None:
        """Count it, and tell the callbacks (alerts go out as soon as it is confirmed)."""
        self.metrics.anomalies.labels(type=ep.type).inc()
        for callback in self.on_open:
            callback(ep)

    def _closed(self, ep: Episode) -> None:
        self.closed.append(ep)
        key = anomaly_key(ep.detail())
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
            self._written = {anomaly_key(d) for d in details}
        return self._written

    def _score(self, detector: str, score: float) -> None:
        self.metrics.anomaly_score.labels(detector=detector).set(score)
