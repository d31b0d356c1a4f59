"""`Monitor`: what a user adds to any torchrun training loop to get meshscope's metrics.

Nothing here blocks the host on the device. Phase times are probe marks (device events on an
accelerator); logged device scalars are gathered into one device buffer per window of
`sync_every` steps, copied to pinned host memory without blocking, and read once an event says
the copy landed, normally one window later (`collector.readback`). The training thread keeps
a step's marks and references only; the Monitor's service thread (`StepDrain`) sends finished
steps (every event completed: `query()`, never `synchronize()`) to the store and /metrics in
step order. Only `flush()` and `close()` wait, and say so ("# sync point").
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from meshscope.collector import readback
from meshscope.collector.comm import (
    BackwardWatch,
    CommMeter,
    CommWindow,
    DDPRuntimeStats,
    Hook,
    WireBytes,
    allreduce_sent_bytes,
    allreduce_wire_bytes,
    ddp_gradient_bytes,
    flat_inter_bytes,
    instrument_hook,
)
from meshscope.collector.control import ControlPlane
from meshscope.collector.drain import StepDrain
from meshscope.collector.env import DistEnv, HostShare, process_start_time
from meshscope.collector.expert_counts import ExpertCounts
from meshscope.collector.exporter import RANK_JOB, PortInUseError, port_for, serve_metrics, write_targets
from meshscope.collector.flightfixed import ReductionRecord
from meshscope.collector.flightlog import FlightLog
from meshscope.collector.flightread import DEVICE_STEP_OFFSET, PROGRESS_OFFSET, STEP_OFFSET
from meshscope.collector.metrics import MeshscopeMetrics
from meshscope.collector.monitor_config import MonitorConfig
from meshscope.collector.native import fast as _fast
from meshscope.collector.probe import DeviceProbe, HostProbe
from meshscope.collector.readback import ScalarWindow
from meshscope.collector.schema import Event
from meshscope.collector.scope import PendingStep, StepContext, StepScope
from meshscope.collector.stepstate import StepState
from meshscope.collector.store import RunStore
from meshscope.collector.version import VERSION

log = logging.getLogger("meshscope.monitor")


class Monitor:
    """Per-process measurement: StepRecords to the store and to /metrics, expert load, events.

    Under torch.distributed, build it on every rank at the same point: without a `control`
    plane given, it builds one, which may create a gloo side group (a collective call)."""

    def __init__(
        self,
        config: MonitorConfig,
        *,
        env: DistEnv | None = None,
        probe: DeviceProbe | None = None,
        registry: CollectorRegistry | None = None,
        store: RunStore | None = None,
        control: ControlPlane | None = None,
    ) -> None:
        self.config = config
        self.env = env or DistEnv()
        self.probe = probe or HostProbe()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = MeshscopeMetrics(self.registry)
        self.store = store or RunStore(config.run_dir, writer=False)  # StepDrain commits it
        # steps timed in full (phases, the wait for communication), and memory reads
        self._detail_every = config.detail_period(on_device=self.probe.asynchronous)
        self._memory_every = config.memory_every or self._detail_every
        # buckets are timed on steps both timed and sampled: each timing stands for this many
        self._comm_every = math.lcm(self._detail_every, config.comm_sample_every)
        self._backward: BackwardWatch | None = None
        self._ddp_stats: DDPRuntimeStats | None = None
        self._ddp_bytes = (0, 0, 0)  # (raw, wire, across nodes) a step when DDP reduces in C++
        # Built here on every rank (a side group is collective) unless the caller shares one.
        self.control = control if control is not None else ControlPlane.maybe()
        # steps the training thread finished, oldest first: it appends, the drain pops
        self._pending: deque[PendingStep | tuple] = deque()  # a tuple: a step C took
        # Host steps run in C (`_route_steps`): `mon.step` is then its context
        self._steps = self._c_steps() if _fast is not None else None
        # the step state the entry points share (`collector.stepstate`): C's struct, or Python's
        self._state: Any = self._steps if self._steps is not None else StepState()
        if self._steps is not None:
            self.step = self._steps.step  # type: ignore[method-assign]
        self.meter = CommMeter(self.probe, self._state)
        self._window = ScalarWindow()
        self._window_steps = 0
        self.experts = ExpertCounts(config.expert_every)
        self.experts.control = self.control
        self.experts.host_counts = not self.probe.asynchronous  # may be summed off this thread
        # Called with (step, [layers, experts] tokens summed over ranks) on every rank, on the
        # device, one step after the window closed: what a trainer needs to act on the global
        # load (the aux-loss-free bias update) without reading it back. Register before the
        # first window closes: without a listener then, host windows are summed off the
        # training thread for the whole run (`collector.expert_counts`).
        self.expert_load_listeners = self.experts.listeners
        self._server = None
        self._closed = False
        # run_start and run_end written (by the trainer, else at the first step and at close)
        self._described = self._ended = self._sdk_run = False
        self._compression = "none"  # what watch() was given, for an SDK run's run_start
        self._host_only = False  # the watched model computes on the host (no device scalars)
        self.flight = self._open_flight_log() if config.flight_log else None
        if config.metrics_port is not None:
            self._start_exporter()
        self._service = StepDrain(self, config.drain_interval_s, config.record_every_s).start()

    @classmethod
    def from_env(cls, run_dir: str | Path, **kwargs: Any) -> Monitor:
        """Build a Monitor for this torchrun worker; keyword arguments go to MonitorConfig,
        except `probe`, `registry` and `store`."""
        extra = {k: kwargs.pop(k) for k in ("probe", "registry", "store", "control") if k in kwargs}
        return cls(MonitorConfig(run_dir=Path(run_dir), **kwargs), env=DistEnv.from_environ(), **extra)

    # --- set-up -------------------------------------------------------------------------
    def _open_flight_log(self) -> FlightLog:
        """This rank's flight log, installed and answering the watchdog."""
        log = FlightLog(
            self.config.run_dir / "live",
            rank=self.env.rank,
            world_size=self.env.world_size,
            attempt=self.env.restart_count,
            capacity=self.config.flight_capacity,
            probe=self.probe,  # on a device: completion and progress from its events
        )
        log.defer_ends = True  # step ends are written by the drain, off the training thread
        return log.install().start_responder()

    def _start_exporter(self) -> None:
        port = port_for(self.config.metrics_port, self.env.local_rank)
        labels = (
            {"job": RANK_JOB, "run": self.config.run_id, "rank": str(self.env.rank), "node": self.env.node}
            if self.config.metrics_labels
            else None
        )
        try:
            self._server = serve_metrics(self.registry, port, self.config.metrics_address, labels)
        except PortInUseError as err:  # taken since the launcher checked: a named failure, no death
            self.fail(err)
            self.training_over()
            raise
        if self.env.local_rank == 0:
            ports = {r: port_for(self.config.metrics_port, i) for i, r in enumerate(self.env.local_ranks())}
            write_targets(
                self.config.run_dir,
                run_id=self.config.run_id,
                host=self.config.metrics_address,
                ports_by_rank=ports,
                node=self.env.node,
            )

    def describe_run(
        self, *, device: str, backend: str, compression: str, started_at: float | None = None
    ) -> None:
        """Fill `meshscope_run_info` and write a run_start event; `started_at`: when this worker
        started (default: the process's start), where the run's start-up time is counted from."""
        self._described = True
        self._route_steps()
        self.metrics.describe_run(
            device=device,
            backend=backend,
            world_size=self.env.world_size,
            compression=compression,
            version=VERSION,
        )
        if self.env.rank == 0:
            self.event(
                "run_start",
                detail={
                    "device": device,
                    "backend": backend,
                    "world_size": self.env.world_size,
                    "compression": compression,
                    "process_started_at": started_at if started_at is not None else process_start_time(),
                },
            )

    def watch(
        self,
        model: torch.nn.Module,
        *,
        comm_hook: Hook | None = None,
        hook_state: Any = None,
        wire_bytes: WireBytes | None = None,
        inter_bytes: WireBytes | None = None,
    ) -> torch.nn.Module:
        """Instrument a (DDP) model: time its gradient communication and read its MoE layers.

        A DDP model with `comm_hook` gets it wrapped with byte counting and, on sampled steps,
        per-bucket timing. Without one, DDP keeps its C++ all-reduce (no Python per bucket) and
        its own sampled timing is read. Either way the wait for communication after backward
        is measured every step. Register compression through here, not on the model.
        `inter_bytes`: what the hook sends across nodes per bucket (default: a flat ring's share).
        """
        self._attach_control_plane()
        if comm_hook is not None:
            self._compression = getattr(comm_hook, "__name__", "custom").removesuffix("_hook")
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        self.experts.attach(model, hook=not ddp)  # a DDP model's one forward hook counts them
        if ddp:
            world = self.env.world_size
            record = None
            if comm_hook is None:
                # DDP reads its timers by waiting on the device: on accelerators keep its own
                # (rare) sampling instead of adding waits; on the host sampling is free.
                every = None if self.probe.asynchronous else self._comm_every
                if self._ddp_stats is not None:  # a model watched before: its reader goes
                    self._ddp_stats.stop(wait=False)
                self._ddp_stats = DDPRuntimeStats(model, every).start()
                sent = allreduce_sent_bytes(ddp_gradient_bytes(model.module), world)
                inter = flat_inter_bytes(sent, world, self.env.ranks_per_node)
                self._ddp_bytes = (sent, sent, inter)  # no compression: raw and wire are one count
                if self.flight is not None:  # the step's reduction as one record, DDP in C++
                    record = ReductionRecord(self.flight, model)
            else:
                wire = wire_bytes or allreduce_wire_bytes
                timed = instrument_hook(
                    comm_hook, self.meter, wire, world, self.env.ranks_per_node, inter_bytes
                )
                model.register_comm_hook(hook_state, timed)
            counted = self.experts.forward_done if self.experts.layers else None
            self._backward = BackwardWatch(self.meter, record, after_forward=counted)
            if self._steps is not None:  # untimed steps' forwards watched in C
                self._backward.fast = (self._steps, self._backward, self.experts)
            self._backward.attach(model)
        param = next(model.parameters(), None)
        on_host = param is None or param.device.type == "cpu"
        self._host_only = on_host and not self.probe.asynchronous
        self._describe_host(on_host)
        self._route_steps()
        return model

    def _attach_control_plane(self) -> None:
        """A Monitor built before `init_process_group` gets its control plane now (watch() runs
        at the same point on every rank, as building it needs); one warning when there is still
        no process group in a job of several ranks."""
        if self.control is not None or self.env.world_size <= 1:
            return
        self.control = self.experts.control = ControlPlane.maybe()
        if self.control is None:
            why = "call init_process_group before Monitor.watch(), or expert load and controls stay off"
            log.warning(
                "meshscope: torch.distributed is not initialised in a job of %d ranks: %s",
                self.env.world_size,
                why,
            )

    def _describe_sdk_run(self) -> None:
        """run_start for a loop that is not meshscope's trainer (which describes its run)."""
        up = torch.distributed.is_available() and torch.distributed.is_initialized()
        device = getattr(self.probe, "kind", "accelerator" if self.probe.asynchronous else "cpu")
        backend = str(torch.distributed.get_backend()) if up else "none"
        self.describe_run(device=str(device), backend=backend, compression=self._compression)
        self._sdk_run = True  # its end is close(): nothing else will say the run ended

    def _describe_host(self, on_host: bool) -> None:
        """One `host` event per node (collector.env.HostShare): what its ranks share. A model on
        an accelerator computes there: each rank then keeps one host thread busy, not torch's
        intra-op pool, so a GPU node is not called oversubscribed for its CPU threads."""
        if self.env.local_rank != 0:
            return
        share = HostShare.measure(self.env.local_world_size, threads=None if on_host else 1)
        self.event("host", detail={"node": self.env.node, **share.detail()})

    # --- the step -------------------------------------------------------------------------
    def step(self, tokens: int = 0, step: int | None = None) -> StepContext:
        """`with mon.step(tokens=n) as s:` measures one training step; `step` defaults to the
        previous one plus one."""
        return StepContext(self, tokens, step)

    @property
    def _step(self) -> int:
        """The latest step begun (kept where the steps run: in C when they do)."""
        return self._state.current

    @_step.setter
    def _step(self, step: int) -> None:
        self._state.current = step

    def _c_steps(self) -> Any:
        """C's steps (`collector/csrc/`), writing the step and, as one ends, its progress into
        the flight log's header (`StepMarks.reached`)."""
        every = (self._detail_every, self._memory_every)
        offsets = {"progress_offset": PROGRESS_OFFSET, "reached_offset": DEVICE_STEP_OFFSET}
        return _fast.Steps(self, self._pending, *every, STEP_OFFSET, **offsets)

    def _route_steps(self) -> None:
        """Let untimed steps run in C where they can: on the host, with every logged value
        there (a watched host model), the run described and its flight log's step ends
        written by the drain. Called whenever one of those changes."""
        if self._steps is None:
            return
        flight = self.flight
        ok = (
            not self.probe.asynchronous
            and self._host_only
            and self._described
            and not self._closed
            and (flight is None or (flight.defer_ends and flight._device is None))
        )
        host_marks = self.probe.mark is time.perf_counter  # a timed step's marks in C
        host_memory = type(self.probe) is HostProbe  # its memory read too (`_fast.rss`)
        self._steps.attach(
            flight, self._backward, self.meter, self.experts, ok, host_marks, self._comm_every, host_memory
        )

    def _begin(self, tokens: int, step: int | None) -> tuple[StepScope, float, Any]:
        if not self._described:
            self._describe_sdk_run()
        step = self._step = self._step + 1 if step is None else step
        if self.flight is not None:
            self.flight.step_begin(step)
        detailed = step % self._detail_every == 0
        if detailed:  # communication outside a step (e.g. DDP's init broadcast) is not ours
            self.meter.take(sample_next=step % self._comm_every == 0)
        self._state.timing = detailed
        return StepScope(self.probe, detailed), time.time(), self.probe.mark()

    def _end(self, scope: StepScope, tokens: int, wall: float, start: Any) -> None:
        # the training thread's part: marks and references. Records, gauges and rows are the
        # service thread's (`StepDrain`), a window late.
        step, end = self._step, self.probe.mark()
        if step % self._memory_every == 0:  # read where the step ends: a leak shows step by step
            self._state.memory = self.probe.memory()
        detailed = scope.detailed
        comm = self._take_comm()
        scalars = scope.scalars
        pending = PendingStep(
            step, tokens, wall, (start, end), scope.phases, comm, self._state.memory, detailed, scalars
        )
        self._take_scalars(pending, scalars)
        self._pending.append(pending)
        if self.flight is not None:
            reduced = self._backward.take_open() if self._backward is not None else ()
            self.flight.step_end(pending.bounds[1], reduced)
        self.experts.step_ended(step)
        self._window_steps += 1
        if self._window_steps >= self.config.sync_every:
            self._close_window()

    def _take_comm(self) -> CommWindow:
        # buckets are timed on timed steps only: the next begin of one says whether
        comm = self.meter.take(sample_next=False)
        watch = self._backward
        reduced = watch is not None and watch.take_reduced()
        if self._ddp_stats is not None and reduced:  # a backward ran: DDP reduced every gradient once
            comm.bytes_raw, comm.bytes_wire, comm.bytes_inter = self._ddp_bytes
        return comm

    def _take_scalars(self, p: PendingStep, scalars: dict[str, Any]) -> None:
        """Kept as references, read by the drain: host values then, device tensors through the
        window's one buffer (a logged tensor must not change in place afterwards)."""
        if self._host_only:  # every value is on the host: the drain reads them
            return
        on_device = [
            k for k, v in scalars.items() if v.__class__ is not float and readback.is_device_tensor(v)
        ]
        if on_device:
            p.device_keys = on_device
            p.window, p.offset = self._window, self._window.add([scalars[k] for k in on_device])

    def _close_window(self) -> None:
        self._window.close()
        self._window, self._window_steps = ScalarWindow(), 0

    def _drain(self, block: bool) -> None:
        """Emit finished steps in order (`StepDrain.drain`)."""
        self._service.drain(block)

    # --- events and shutdown ----------------------------------------------------------------
    def event(
        self,
        kind: str,
        *,
        severity: str = "info",
        step: int | None = None,
        detail: dict[str, Any] | None = None,
    ) -> Event:
        """Record an Event of this run (store, and the flight log's timeline)."""
        ev = Event(
            kind=kind,
            run_id=self.config.run_id,
            severity=severity,
            rank=self.env.rank,
            step=self._step if step is None else step,
            detail=detail or {},
        )
        self.store.add_event(ev)
        self._ended = self._ended or kind == "run_end"
        return ev

    def fail(self, error: BaseException) -> None:
        """Say why this rank is going down, for the hang watchdog: a rank that raised is a
        culprit, not one more victim of a dead peer."""
        if self.flight is not None:
            self.flight.note_error(error)

    def flush(self) -> None:
        """Emit every pending step (waits for the device) and commit the store. Expert-load
        windows summed off the training thread land a group at a time: those of a group
        still filling wait for it, or for `close()` (`collector.expert_counts`)."""
        self._close_window()
        self._drain(block=True)
        self.store.flush()

    def training_over(self) -> None:
        """No more steps or collectives will come (the process may still linger for a last
        scrape): the hang watchdog must not take the quiet for a stall."""
        if self.flight is not None:
            self.flight.close()

    def close(self) -> None:
        """Materialise what is pending, commit the store and stop the exporter."""
        if self._closed:
            return
        self._closed = True
        self._route_steps()
        self._service.stop()
        self._close_window()
        self.experts.closing = True  # every rank ends here after the same steps: the last group
        self._drain(block=True)
        if self._ddp_stats is not None:
            self._ddp_stats.stop()
        if self._sdk_run and not self._ended and self.env.rank == 0:  # an SDK run ends here
            self.event("run_end", detail={"steps": self._step + 1, "reason": "closed"})
        self.store.close()
        if self.flight is not None:
            self.flight.close()
        if self._server is not None:
            server, _thread = self._server
            server.shutdown()
            server.server_close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ended = self._ended or exc[0] is not None  # a loop that raised did not finish
        self.close()
