"""One step as the Monitor sees it on the host: the scope a loop times phases and logs scalars
in, the context `Monitor.step()` returns, and the pending record whose numbers may still be on
the device."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from meshscope.collector.comm import CommWindow, step_comm_seconds
from meshscope.collector.native import fast as _fast
from meshscope.collector.probe import DeviceProbe
from meshscope.collector.readback import ScalarWindow
from meshscope.collector.schema import StepRecord


@dataclass(slots=True)
class PendingStep:
    """A finished step whose numbers may still live on the device."""

    step: int
    tokens: int
    wall_time: float
    bounds: tuple[Any, Any]
    phases: dict[str, tuple[Any, Any]]
    comm: CommWindow
    memory: dict[str, int]
    detailed: bool = True  # phases and the wait timed (`detail_every`); NaN otherwise
    # what was logged: set by the Monitor as the step ends (no default dict or list built on
    # the training thread for steps that log nothing on the device)
    scalars: dict[str, Any] = field(default_factory=dict)
    device_keys: tuple[str, ...] | list[str] = ()
    window: ScalarWindow | None = None
    offset: int = 0

    def marks(self) -> list[Any]:
        """Every device mark this step's record reads."""
        hops = [(a, b) for _, a, b in self.comm.hops]
        spans = [self.bounds, *self.phases.values(), *self.comm.spans, self.comm.wait, *hops]
        return [m for span in spans for m in span if m is not None]

    def record(self, probe: DeviceProbe, scalars: dict[str, float], run_id: str, env: Any) -> StepRecord:
        """The step's record, once its marks are finished (reading them does not wait)."""
        p, sec = self, probe.seconds
        step_s = sec(*p.bounds)
        if p.detailed:
            phases = {name: sec(*span) for name, span in p.phases.items()}
            comm_total, comm_exposed = step_comm_seconds(probe, p.comm, p.bounds[0])
            unmeasured = 0.0  # a phase the loop does not time took no time
        else:  # not timed this step: NaN, which readers skip (`detail_every`)
            phases, comm_total, comm_exposed = {}, math.nan, math.nan
            unmeasured = math.nan
        hops = p.comm.hop_seconds(probe)
        a2a = hops["expert_all_to_all"]
        if math.isfinite(a2a):  # the step waited for its expert all-to-all: communication too
            comm_total, comm_exposed = comm_total + a2a, comm_exposed + a2a
        nonfinite = ",".join(sorted(k for k, v in scalars.items() if not math.isfinite(v)))
        mem = p.memory
        return StepRecord(
            run_id=run_id,
            rank=env.rank,
            world_size=env.world_size,
            step=p.step,
            time=p.wall_time,
            step_s=step_s,
            forward_s=phases.get("forward", unmeasured),
            backward_s=phases.get("backward", unmeasured),
            optimizer_s=phases.get("optimizer", unmeasured),
            data_s=phases.get("data", unmeasured),
            comm_total_s=comm_total,
            comm_exposed_s=comm_exposed,
            comm_ratio=_share(comm_exposed, step_s),
            bytes_raw=p.comm.bytes_raw,
            bytes_wire=p.comm.bytes_wire,
            comm_intra_s=hops["intra_node"],
            comm_inter_s=hops["inter_node"],
            bytes_inter=p.comm.bytes_inter,
            comm_a2a_s=a2a,
            bytes_a2a=p.comm.bytes_a2a,
            loss=scalars.get("loss", math.nan),
            grad_norm=scalars.get("grad_norm", math.nan),
            tokens=p.tokens,
            tokens_per_s=p.tokens / step_s if step_s > 0 else 0.0,
            mem_allocated=mem.get("allocated", 0),
            mem_reserved=mem.get("reserved", 0),
            mem_rss=mem.get("rss", 0),
            nonfinite=nonfinite,
            attempt=env.restart_count,
        )


def _share(exposed: float, step_s: float) -> float:
    """Exposed communication over the step, at most 1; NaN when it was not timed."""
    if math.isnan(exposed):
        return math.nan
    return min(1.0, exposed / step_s) if step_s > 0 else 0.0


class PhaseTimer:
    """A phase's two marks (a plain class: a generator-based context costs more per step)."""

    __slots__ = ("scope", "name", "start")

    def __init__(self, scope: StepScope, name: str) -> None:
        self.scope, self.name = scope, name

    def __enter__(self) -> None:
        self.start = self.scope._probe.mark()

    def __exit__(self, *exc: Any) -> None:
        self.scope.phases[self.name] = (self.start, self.scope._probe.mark())


# The phase of a step that is not timed (`detail_every`): a context that does nothing
# observable, in C. A fresh lock per phase (never shared, so never waited for, nested or from
# any thread): entering and leaving it runs no Python frame, which after a phase's compute
# costs the step microseconds each.
Untimed = threading.Lock


class StepScope:
    """Handed out by `Monitor.step()`: time named phases and log scalars."""

    __slots__ = ("_probe", "phases", "scalars", "detailed")

    def __init__(self, probe: DeviceProbe, detailed: bool = True) -> None:
        self._probe = probe
        self.phases: dict[str, tuple[Any, Any]] = {}
        self.scalars: dict[str, Any] = {}
        self.detailed = detailed  # phases are timed on this step

    def phase(self, name: str) -> PhaseTimer | Any:
        """`with s.phase("forward"): ...` times a named part of the step (on a timed step)."""
        if not self.detailed:
            return Untimed()
        if self._probe.mark is time.perf_counter and _fast is not None:  # the host's marks, in C
            return _fast.Phase(self.phases, name)
        return PhaseTimer(self, name)

    def log(self, **scalars: Any) -> None:
        """Record loss, grad_norm, ...: tensors are kept as they are and read later."""
        for key, value in scalars.items():
            # kept without its graph (a loss holds the step's); a tensor with none is kept as is.
            # `.data`, not `detach()`: the same storage, without a trip through the dispatcher
            graph = isinstance(value, torch.Tensor) and value.requires_grad
            self.scalars[key] = value.data if graph else value


class StepContext:
    """The context `Monitor.step()` returns (a plain class: cheaper than a generator)."""

    __slots__ = ("mon", "tokens", "step", "scope", "wall", "start")

    def __init__(self, mon: Any, tokens: int, step: int | None) -> None:
        self.mon, self.tokens, self.step = mon, tokens, step

    def __enter__(self) -> StepScope:
        self.scope, self.wall, self.start = self.mon._begin(self.tokens, self.step)
        return self.scope

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:  # a step that raised is not a step
            self.mon._end(self.scope, self.tokens, self.wall, self.start)


class OpenStep:
    """A step whose bounds and phases are separate calls rather than `with` blocks: a
    framework's callbacks (`collector.hf`, `collector.lightning`) see only hook boundaries.
    `phase(name)` ends the running phase and starts `name`; `end()` ends the step."""

    def __init__(self, mon: Any, step: int | None = None) -> None:
        self._context = StepContext(mon, 0, step)
        self.scope = self._context.__enter__()
        self._phase: tuple[str, Any] | None = None

    def phase(self, name: str) -> None:
        """The running phase ends here and `name` starts (on a timed step)."""
        if not self.scope.detailed:
            return
        now = self.scope._probe.mark()
        self._close_phase(now)
        self._phase = (name, now)

    def _close_phase(self, now: Any) -> None:
        if self._phase is not None:
            self.scope.phases[self._phase[0]] = (self._phase[1], now)

    def end(self, tokens: int = 0) -> None:
        """The step is over: its running phase ends with it."""
        if self.scope.detailed:
            self._close_phase(self.scope._probe.mark())
        self._context.tokens = tokens
        self._context.__exit__(None, None, None)


def batch_tokens(batch: Any) -> int:
    """Tokens in a batch, read from its shapes (no sync): the first integer tensor's elements
    (token ids), else the first tensor's rows; 0 when it holds no tensor."""
    tensors = _tensors(batch)
    ids = next((t for t in tensors if not t.is_floating_point() and t.dim() >= 1), None)
    if ids is not None:
        return ids.numel()
    return tensors[0].shape[0] if tensors and tensors[0].dim() else 0


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else []
    return [t for v in values for t in _tensors(v)]
