"""The Monitor's service thread: the steps the training thread finished become records, gauges
and store rows, in step order, a batch at a time (`monitor.record_every_s`); between batches
its rounds (`monitor.drain_interval_s`) write the flight log's step ends (the reductions each
completed, the typical step time; a step's progress is written as it ends). It also commits
the store the Monitor built (no writer thread of its own).

The training thread hands over marks and references only: a `PendingStep` from the Python path
(a device's steps, or where C was not built), or a tuple from C (`collector/csrc/`: host steps).
Here both become the same record."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any

from meshscope.collector.comm import CommWindow
from meshscope.collector.probe import mark_ready, wait_mark
from meshscope.collector.schema import StepRecord
from meshscope.collector.scope import PendingStep
from meshscope.collector.service import Service, due

if TYPE_CHECKING:
    from meshscope.collector.monitor import Monitor

log = logging.getLogger("meshscope.monitor")

# how long a round waits for DDP's figure (a read takes ~50 us; a busy host can delay it). A
# reduction that holds DDP's lock longer (a hang) leaves the figure read before, and the
# rounds after do not wait while that read is stuck (`DDPRuntimeStats.refresh`).
DDP_READ_WAIT_S = 1.0


class StepDrain(Service):
    """The Monitor's service thread (module doc)."""

    def __init__(self, monitor: Monitor, interval_s: float, record_every_s: float) -> None:
        super().__init__("meshscope-monitor", interval_s, join_s=10.0)
        self.monitor = monitor
        # A round that makes records pays a fixed part each time (the gauges, DDP's figure, the
        # expert windows' sums, all cold after the step's compute): records are made once every
        # `record_every_s`, a batch of steps at a time. The flight log's step ends are written
        # every round: the records of the reductions they completed.
        self.record_every_s = record_every_s
        self._recorded_at = time.monotonic()
        self._lock = threading.Lock()  # rounds against flush and close
        self.logged_keys: set[str] = set()  # what the latest step logged
        self._unreadable: set[str] = set()  # logged keys whose value was no number (said once)
        self._loss_was_finite = True
        self._plain_windows: dict[tuple[int, int, int], CommWindow] = {}  # `_plain_window`

    def round(self) -> None:
        """Drain what has finished when records are due; the flight log's step ends always."""
        # half a round's slack: a round woken a little early is not put off a whole round
        if due(self._recorded_at, self.record_every_s, slack_s=self.interval_s / 2):
            self.drain(block=False)
        elif self.monitor.flight is not None:
            with self._lock:
                self.monitor.flight.settle_ends()
        # the store the Monitor built has no writer thread: committed here, at the store's own
        # cadence (a commit is a transaction: not one per batch); flush and close commit it too
        store = self.monitor.store
        if store.owner_commits and due(store.committed_at, store.flush_interval_s, self.interval_s / 2):
            store.write_queued()

    def drain(self, block: bool) -> None:
        """Emit finished steps in order; without `block`, stop at the first unfinished one."""
        mon = self.monitor
        with self._lock:
            self._recorded_at = time.monotonic()
            finished = []
            while mon._pending:
                p = mon._pending[0]
                if block:
                    self._wait(p)
                elif not self._finished(p):
                    break
                finished.append(self._as_pending(mon._pending.popleft()))
            self._measure_ddp(finished)
            records = [self._record(p) for p in finished]
            if records:
                mon.metrics.observe_steps(records, mon._comm_every, self.logged_keys, mon._detail_every)
            for rec in records:
                self._emit(rec)
            self._emit_experts(list(mon.experts.landed(block)))
            for step, tokens in mon.experts.landed_work(block):
                mon.metrics.observe_expert_work(tokens)
                mon.store.add_expert_work(step, mon.env.rank, tokens)
            if mon.flight is not None:
                mon.flight.settle_ends()

    def _as_pending(self, item: PendingStep | tuple) -> PendingStep:
        """A step C took (on the host) as the Python path keeps one. A timed step's phases
        are a dict (None untimed); an untimed step's communication window is the meter's only
        when a hook counted in it."""
        if item.__class__ is not tuple:
            return item  # type: ignore[return-value]
        step, tokens, wall, start, end, scalars, comm, reduced, memory, phases = item  # type: ignore[misc]
        mon = self.monitor
        counted = reduced and mon._ddp_stats is not None  # a backward ran: DDP reduced every gradient once
        if comm is None:  # no hook counted: one window per figure, shared by the steps it fits
            comm = self._plain_window(mon._ddp_bytes if counted else (0, 0, 0))
        elif counted:
            comm.bytes_raw, comm.bytes_wire, comm.bytes_inter = mon._ddp_bytes
        timed = phases is not None
        return PendingStep(step, tokens, wall, (start, end), phases or {}, comm, memory, timed, scalars or {})

    def _plain_window(self, sent: tuple[int, int, int]) -> CommWindow:
        """The untimed communication window of a step no hook counted in, carrying DDP's bytes
        `sent` (raw, wire, inter-node): shared, never changed after (records read it; a
        sampled window alone takes DDP's timing)."""
        window = self._plain_windows.get(sent)
        if window is None:
            window = self._plain_windows[sent] = CommWindow(sampled=False)
            window.bytes_raw, window.bytes_wire, window.bytes_inter = sent
        return window

    def _measure_ddp(self, steps: list[PendingStep]) -> None:
        """DDP's sampled communication time (a model it reduces in C++) onto this round's
        sampled steps: its latest figure, read on a thread of neither the training loop's nor
        this one's (`DDPRuntimeStats`). DDP samples as often as they come (`_comm_every`), so
        each stands for the steps a bucket timing would."""
        stats = self.monitor._ddp_stats
        sampled = [p for p in steps if p.detailed and p.comm.sampled]
        if stats is None or not sampled:
            return
        seconds = stats.refresh(DDP_READ_WAIT_S)
        for p in sampled:
            p.comm.measured_s = seconds

    def _finished(self, p: PendingStep | tuple) -> bool:
        probe = self.monitor.probe
        if p.__class__ is tuple:  # C takes host steps only: their marks are times taken
            return True
        if p.window is not None and not p.window.ready():  # type: ignore[union-attr]
            return False
        if not probe.asynchronous:  # host marks are times already taken
            return True
        return all(mark_ready(probe, m) for m in p.marks())  # type: ignore[union-attr]

    def _wait(self, p: PendingStep | tuple) -> None:
        """Block until a step's numbers are on the host: flush and close only."""
        if p.__class__ is tuple:
            return
        if p.window is not None:  # type: ignore[union-attr]
            p.window.wait()  # type: ignore[union-attr]
        for m in p.marks():  # type: ignore[union-attr]
            wait_mark(self.monitor.probe, m)  # sync point: flush and close only

    def _emit_experts(self, windows: list[tuple[int, list[list[float]]]]) -> None:
        mon = self.monitor
        if mon.env.rank == 0 and windows:  # summed over ranks: one rank exports (layer x expert)
            mon.metrics.observe_experts([table for _, table in windows])
            for step, table in windows:
                mon.store.add_expert_load(step, table)

    def _record(self, p: PendingStep) -> StepRecord:
        mon = self.monitor
        scalars = {k: self._host_float(k, v) for k, v in p.scalars.items() if k not in p.device_keys}
        if p.window is not None:
            scalars.update(zip(p.device_keys, p.window.values(p.offset, len(p.device_keys))))
        self.logged_keys = set(scalars)
        return p.record(mon.probe, scalars, mon.config.run_id, mon.env)

    def _host_float(self, key: str, value: Any) -> float:
        """A logged host value as a float; NaN, said once per key, for one that is not a number."""
        try:
            return float(value)  # host tensor (or a number): no wait
        except (TypeError, ValueError, RuntimeError) as err:
            if key not in self._unreadable:
                self._unreadable.add(key)
                log.warning("meshscope: logged %r is not a number (%s); recorded as NaN", key, err)
            return math.nan

    def _emit(self, rec: StepRecord) -> None:
        mon = self.monitor
        mon.store.add_step(rec)
        finite = math.isfinite(rec.loss) or "loss" not in self.logged_keys
        if not finite and self._loss_was_finite and mon.config.nan_events:
            # one event when the loss turns non-finite
            mon.metrics.faults.labels(kind="nonfinite").inc()
            mon.event(
                "nan", severity="critical", step=rec.step, detail={"what": "loss", "value": str(rec.loss)}
            )
        self._loss_was_finite = finite
