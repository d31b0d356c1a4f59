"""Timing and byte counting of DDP communication hooks, whatever the hook compresses.

Bytes on the wire are counted the same way for every hook: what this rank sends for each
collective it issues, by the standard algorithm costs (ring all-reduce 2(W-1)/W of the payload,
all-to-all (W-1)/W, all-gather (W-1) times the own chunk). Hooks describe their collectives
through a `wire_bytes(bucket, state, world_size)` function.

Across nodes, what crosses the node boundary is counted apart (`bytes_inter`): a flat ring
over ranks laid out node by node crosses it on one link per node, so each rank's share is
1/L of what it sends (L ranks per node); a hook that knows better (the hierarchical
all-reduce) says so with its own `inter_bytes`. Hooks that run their hops one by one time them
through `CommMeter.hop` ("intra_node", "inter_node"), measured every step.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist

from meshscope.collector.native import fast as _fast
from meshscope.collector.probe import DeviceProbe
from meshscope.collector.schema import HOP_KINDS
from meshscope.collector.service import Service
from meshscope.collector.stepstate import StepState

# A step no hook timed hops of (most steps): every kind NaN
NO_HOPS: Mapping[str, float] = MappingProxyType(dict.fromkeys(HOP_KINDS, math.nan))

Hook = Callable[[Any, "dist.GradBucket"], torch.futures.Future]
WireBytes = Callable[[Any, "dist.GradBucket", int], int]


def allreduce_sent_bytes(payload: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of `payload` bytes."""
    return 0 if world_size <= 1 else (2 * (world_size - 1) * payload) // world_size


def alltoall_sent_bytes(payload: int, world_size: int) -> int:
    """Bytes one rank sends in an all-to-all of `payload` bytes."""
    return 0 if world_size <= 1 else ((world_size - 1) * payload) // world_size


def allgather_sent_bytes(own_chunk: int, world_size: int) -> int:
    """Bytes one rank sends in an all-gather of its `own_chunk`."""
    return max(0, world_size - 1) * own_chunk


def bucket_bytes(bucket: dist.GradBucket) -> int:
    """A DDP gradient bucket's size in bytes."""
    buf = bucket.buffer()
    return buf.numel() * buf.element_size()


def allreduce_wire_bytes(state: Any, bucket: dist.GradBucket, world_size: int) -> int:
    """Wire bytes of the plain all-reduce hook: the whole fp32 bucket, ring all-reduced."""
    return allreduce_sent_bytes(bucket_bytes(bucket), world_size)


def flat_inter_bytes(wire: int, world_size: int, local_size: int) -> int:
    """This rank's share of what a flat ring sends across nodes: the ring crosses the node
    boundary on one link per node, so a node sends one rank's `wire` across, 1/L per rank."""
    local = max(1, local_size)
    return 0 if world_size <= local else wire // local


@dataclass(slots=True)
class CommWindow:
    """Communication seen during one step.

    `wait` spans the moment backward compute ended (the autograd graph finished) to the moment
    DDP had every bucket reduced: the communication the step waited for, measured every step.
    `spans` are per-bucket launch/completion marks and `measured_s` DDP's own figure, both
    on sampled steps only."""

    spans: list[tuple[Any, Any]] = field(default_factory=list)
    wait: list[Any] = field(default_factory=functools.partial(list, (None, None)))  # no Python frame
    measured_s: float | None = None
    sampled: bool = False
    bytes_raw: int = 0
    bytes_wire: int = 0
    bytes_inter: int = 0
    bytes_a2a: int = 0
    hops: list[tuple[str, Any, Any]] = field(default_factory=list)
    """(kind, start, end) of each hop a hook timed: intra- or inter-node (`HOP_KINDS`)."""

    def hop_seconds(self, probe: Any) -> Mapping[str, float]:
        """Seconds per hop kind over the step; NaN for a kind nothing timed."""
        if not self.hops:  # most steps: one shared answer, read only
            return NO_HOPS
        out = dict.fromkeys(HOP_KINDS, math.nan)
        for kind, a, b in self.hops:
            seconds = probe.seconds(a, b)
            out[kind] = seconds if math.isnan(out[kind]) else out[kind] + seconds
        return out


class HopTimer:
    """`with meter.hop("inter_node"):` marks one hop of a bucket's reduction (a plain class)."""

    __slots__ = ("meter", "kind", "start")

    def __init__(self, meter: CommMeter, kind: str) -> None:
        self.meter, self.kind = meter, kind

    def __enter__(self) -> None:
        self.start = self.meter.probe.mark()

    def __exit__(self, *exc: Any) -> None:
        self.meter.add_hop(self.kind, self.start, self.meter.probe.mark())


class CommMeter:
    """Collects a step's communication; the Monitor swaps windows at step boundaries.

    Bucket hooks cost a Python call per bucket, so per-bucket marks are taken on sampled steps
    only (`sampling`); bytes are counted always."""

    def __init__(self, probe: DeviceProbe, state: StepState | None = None) -> None:
        self.probe = probe
        self._lock = threading.Lock()  # completions arrive on the backend's threads
        self._window = CommWindow(sampled=True)
        # `state.dirty`: something was put in the window since the last take. An untimed step
        # that ends with it clean leaves it in place (`collector/csrc/` swaps no window then).
        self.state = state if state is not None else StepState()

    @property
    def sampling(self) -> bool:
        """Whether the step in progress times its buckets."""
        return self._window.sampled

    def count(self, raw: int, wire: int, inter: int = 0) -> None:
        """Add a bucket's raw, on-the-wire and across-nodes bytes to this window."""
        with self._lock:
            self.state.dirty = True
            self._window.bytes_raw += raw
            self._window.bytes_wire += wire
            self._window.bytes_inter += inter

    def count_exchange(self, wire: int) -> None:
        """Add the bytes one expert all-to-all sent to this window."""
        with self._lock:
            self.state.dirty = True
            self._window.bytes_a2a += wire

    def launched(self, raw: int, wire: int, inter: int = 0) -> list[Any]:
        """A bucket's collective was issued: returns its timing span."""
        mark = self.probe.mark()
        span = [mark, None]
        with self._lock:
            self.state.dirty = True
            self._window.bytes_raw += raw
            self._window.bytes_wire += wire
            self._window.bytes_inter += inter
            self._window.spans.append(span)  # type: ignore[arg-type]
        return span

    def hop(self, kind: str) -> HopTimer:
        """Time one hop of a bucket's reduction (`HOP_KINDS`), on any thread."""
        if kind not in HOP_KINDS:
            raise ValueError(f"hop kind {kind!r}: one of {HOP_KINDS}")
        return HopTimer(self, kind)

    def add_hop(self, kind: str, start: Any, end: Any) -> None:
        """A timed hop's marks, into the step in progress."""
        with self._lock:
            self.state.dirty = True
            self._window.hops.append((kind, start, end))

    def completed(self, span: list[Any]) -> None:
        """The collective of `span` finished."""
        span[1] = self.probe.mark()

    def compute_done(self) -> None:
        """Backward finished: the wait for communication starts."""
        self.state.dirty = True
        self._window.wait[0] = self.probe.mark()

    def reduced(self) -> None:
        """Every bucket is reduced: the wait for communication ends."""
        self.state.dirty = True
        self._window.wait[1] = self.probe.mark()

    def take(self, sample_next: bool = True) -> CommWindow:
        """This step's window; the next one is sampled when `sample_next`."""
        with self._lock:
            window, self._window = self._window, CommWindow(sampled=sample_next)
            self.state.dirty = False
        return window


def instrument_hook(
    hook: Hook,
    meter: CommMeter,
    wire_bytes: WireBytes,
    world_size: int,
    local_size: int | None = None,
    inter_bytes: WireBytes | None = None,
) -> Hook:
    """Wrap a DDP comm hook: bytes counted every step, each bucket timed on sampled steps.
    `local_size`: ranks per node (the flat ring's share crosses nodes when the world is
    bigger); `inter_bytes`: a hook's own count of what it sends across nodes."""
    local = world_size if local_size is None else local_size

    def timed_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
        # one count: bytes this rank sends, as a plain all-reduce would (raw) and as sent (wire)
        raw = allreduce_sent_bytes(bucket_bytes(bucket), world_size)
        wire = wire_bytes(state, bucket, world_size)
        if inter_bytes is not None:
            inter = inter_bytes(state, bucket, world_size)
        else:
            inter = flat_inter_bytes(wire, world_size, local)
        if not meter.sampling:
            meter.count(raw, wire, inter)
            return hook(state, bucket)
        span = meter.launched(raw, wire, inter)
        fut = hook(state, bucket)

        def done(f: torch.futures.Future) -> Any:
            meter.completed(span)
            return f.value()

        # `then`, not add_done_callback: DDP waits on the chained future, so the completion
        # mark is in place before the step's record is built.
        return fut.then(done)

    timed_hook.__name__ = f"timed_{getattr(hook, '__name__', 'hook')}"
    # DDP checks real annotation objects, not the strings `from __future__` leaves.
    timed_hook.__annotations__ = {
        "state": object,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    return timed_hook


class BackwardWatch:
    """Marks when a DDP model's backward compute ends and when its reduction is done.

    A pre-hook on the autograd node of the model's output fires as backward starts and queues
    an autograd-engine callback; the engine runs it once the graph is done (compute over),
    before DDP's own finalizer, which waits for every bucket; that callback queues one more,
    which runs after the finalizer (all reduced). A few Python calls a step, whatever the
    number of buckets. `record` (begin() -> token, end(token)) is told both moments too: the
    flight log's one record of the step's reduction while DDP reduces in C++.

    On a step that is not timed (`timing` False: `monitor.detail_every`) there is no hook and
    no callback: the record opens as the forward ends (the backward that follows reduces) and
    closes when the step ends (`take_open`), which a rank stuck in the reduction never
    reaches."""

    def __init__(self, meter: CommMeter, record: Any = None, after_forward: Any = None) -> None:
        self.meter = meter
        self.record = record
        self.after_forward = after_forward  # more to do after each forward, in the same hook
        # the meter's step state (`collector.stepstate`): `timing` (the step in progress is
        # timed: mark the wait), `reduced` (a backward that reduces gradients ran since the last
        # take), `opened` (records opened at a forward's end on an untimed step)
        self.state = meter.state
        self._token: Any = None
        # (Steps, this watch, ExpertCounts): the Monitor's host steps watch in C
        # (`collector/csrc/` does what `_on_forward` does on such a step)
        self.fast: tuple[Any, BackwardWatch, Any] | None = None

    def attach(self, model: torch.nn.Module) -> None:
        """Watch `model`'s forwards so the end of its backward is seen."""
        after_forward(model, self._on_forward, self.fast)

    def take_reduced(self) -> bool:
        """Whether a forward whose backward reduces gradients ran since the last call (on a
        step that is not timed, the bytes DDP sent are known from this alone)."""
        state = self.state
        reduced, state.reduced = state.reduced, False
        return reduced

    def _on_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.after_forward is not None:
            self.after_forward()
        self.forward_ended(module, output)

    def forward_ended(self, module: torch.nn.Module, output: Any) -> None:
        """After a forward, once its expert counts are noted (C notes them itself): DDP's
        reduction record, or on a timed step the hook that marks the backward's end."""
        if not torch.is_grad_enabled():
            return
        # under no_sync() DDP reduces nothing this backward: nothing to record
        syncs = getattr(module, "require_backward_grad_sync", True)
        state = self.state
        state.reduced = state.reduced or syncs
        if not state.timing:  # no hook, no callback: the record spans to the step's end
            if syncs and self.record is not None:
                state.opened.append(self.record.begin())
            return
        node = _grad_node(output)
        if node is not None:  # a pre-hook on the output's node: C++, cheaper than a tensor hook
            node.register_prehook(self._on_backward_start if syncs else self._on_local_backward)

    def take_open(self) -> list[Any]:
        """The step is over: the records its untimed forwards opened, all reduced now (the
        flight log completes them, `FlightLog.step_end`)."""
        state = self.state
        opened = state.opened
        if opened:
            state.opened = []
        return opened

    def _on_backward_start(self, grad_outputs: Any) -> None:
        if self.record is not None:
            self._token = self.record.begin()
        torch.autograd.Variable._execution_engine.queue_callback(self._on_graph_done)

    def _on_local_backward(self, grad_outputs: Any) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._on_graph_done)

    def _on_graph_done(self) -> None:
        if self.state.timing:
            self.meter.compute_done()
        torch.autograd.Variable._execution_engine.queue_callback(self._on_reduced)

    def _on_reduced(self) -> None:
        if self.state.timing:
            self.meter.reduced()
        token, self._token = self._token, None
        if token is not None:
            self.record.end(token)


def after_forward(
    model: torch.nn.Module, hook: Callable[[torch.nn.Module, Any, Any], None], fast: Any = None
) -> None:
    """Call `hook(model, args, output)` after each forward of `model`, as a forward hook would,
    by wrapping its `forward`: any forward hook sends every call of the module through
    nn.Module's slow path (~7 us a call more on a 2-core host, `benchmarks/forward_watch.py`),
    where the wrapper costs one Python frame, or none in C. `fast`: `BackwardWatch.fast`."""
    forward = model.forward
    if _fast is not None:
        model.forward = _fast.Forward(forward, hook, model, fast)
        return

    @functools.wraps(forward)
    def watched(*args: Any, **kwargs: Any) -> Any:
        output = forward(*args, **kwargs)
        hook(model, args, output)
        return output

    model.forward = watched


def _grad_node(output: Any) -> Any:
    """The autograd node of a model output's first tensor that has one (None: no graph). A
    tensor or a flat tuple is read directly: the pytree walk costs more than the rest of the
    hook, every step."""
    if isinstance(output, torch.Tensor):
        return output.grad_fn
    if isinstance(output, (tuple, list)) and (node := _first_node(output)) is not None:
        return node
    return _first_node(torch.utils._pytree.tree_leaves(output))  # nested outputs only


def _first_node(values: Any) -> Any:
    return next((t.grad_fn for t in values if isinstance(t, torch.Tensor) and t.grad_fn is not None), None)


class DDPRuntimeStats(Service):
    """DDP's own sampled communication time, for models whose reduction runs in C++ (no hook).

    DDP times its all-reduce on sampled iterations (the first 10, then one in `every`). Its
    figure is read on a thread of its own, when the Monitor's drain asks (`refresh`): DDP
    builds it under its reducer's lock, which the reduction holds while it waits for every
    bucket, so a rank stuck there stalls whoever reads; here that is this thread alone (the
    binding lets go of the GIL while it waits), not the training thread or the drain, which
    writes the flight records the hang watchdog reads. On accelerators DDP reads its timers
    by waiting at its next sampled forward, so there the Monitor leaves DDP's own rate (1 in
    100) alone."""

    def __init__(self, ddp: torch.nn.Module, every: int | None) -> None:
        super().__init__("meshscope-ddp-stats", interval_s=3600.0, join_s=1.0)  # rounds when asked
        self.ddp = ddp
        self.latest: float | None = None  # seconds: the latest sampled span read, once there is one
        self._read = threading.Event()  # the read asked for is done
        self._asked = False  # a read was asked for
        setter = getattr(ddp, "_set_ddp_runtime_logging_sample_rate", None)
        if setter is not None and every is not None:  # None: DDP's default (1 in 100)
            setter(every)

    def round(self) -> None:
        """Read DDP's figure once."""
        data = self._data()
        if "backward_comm_time" in data and data.get("backward_comm_time_end"):
            self.latest = data["backward_comm_time"] / 1e9
        self._read.set()

    def refresh(self, wait_s: float) -> float | None:
        """DDP's latest figure, read again on this service's thread and waited for at most
        `wait_s`. A reduction that holds DDP's lock longer leaves the figure read before, and
        while that read is still waiting no later call waits again."""
        if self.running and (self._read.is_set() or not self._asked):
            self._read.clear()
            self._asked = True
            self.wake()
            self._read.wait(wait_s)
        return self.latest

    def _data(self) -> dict[str, Any]:
        # the logger's integers only: DDP's own `_get_ddp_logging_data()` also converts its
        # strings and merges both (~2x the cost)
        logger = getattr(self.ddp, "logger", None)
        if logger is not None and hasattr(logger, "_get_ddp_logging_data"):
            return logger._get_ddp_logging_data().ints_map
        reader = getattr(self.ddp, "_get_ddp_logging_data", None)
        return reader() if reader is not None else {}


def ddp_gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of gradient one DDP reduction carries: every parameter that takes a gradient."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def step_comm_seconds(probe: Any, comm: CommWindow, step_start: Any) -> tuple[float, float]:
    """A finished step's (communication in flight, communication it waited for after compute).

    The wait is measured every step (`BackwardWatch`). The time in flight, from the first
    bucket's launch to the last one's completion, only on sampled steps: NaN elsewhere."""
    sec = probe.seconds
    exposed = sec(*comm.wait) if None not in comm.wait else 0.0
    spans = [(a, b) for a, b in comm.spans if b is not None]
    if spans:
        first = min((a for a, _ in spans), key=lambda a: sec(step_start, a))
        last = max((b for _, b in spans), key=lambda b: sec(step_start, b))
        return sec(first, last), exposed
    if comm.measured_s is not None:
        return comm.measured_s, exposed
    return (math.nan if comm.bytes_raw else 0.0), exposed
