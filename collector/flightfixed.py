"""Flight-log records of the collectives meshscope issues again and again with the same op,
group, dtype and shape: DDP's gradient reduction of each step, and the Monitor's expert-load
sum each window. Their fields are packed once, so a record costs one append to the ring
(`collector.flightlog`); describing a call from its arguments and call site, every time,
cost more than launching it."""

from __future__ import annotations

from typing import Any

import torch

from meshscope.collector.flightlog import FlightLog
from meshscope.collector.flightread import RECORD, RECORD_HEAD, STATE_ISSUED, fit


class FixedRecord:
    """A collective issued again and again with the same op, group, dtype and shape (DDP's
    reduction of a step, the Monitor's expert-load sum): its record's fields are packed once,
    so a record costs one append. Describing a call from its arguments and its call site costs
    more than launching it, on every call."""

    def __init__(self, log: FlightLog, group: Any, op: str, dtype: str, shape: str, site: str) -> None:
        self.log, self.group = log, group
        self.fields = (fit(op, 24), fit(dtype, 15), fit(shape, 56), fit(site, 96))
        self._packed: tuple[str, bytes] | None = None  # the group's name and the record's tail

    def begin(self, step: int | None = None) -> int:
        """The collective is issued now (for training step `step`, default the current one):
        its slot."""
        packed = self._packed
        if packed is None:  # at first use: the group's name, and every field that never changes
            name, size = self.log.group_of(self.group)
            packed = self._packed = (name, fixed_tail(fit(name, 16), size, *self.fields))
        return self.log.append_fixed(*packed, step)


def fixed_tail(group: bytes, size: int, op: bytes, dtype: bytes, shape: bytes, site: bytes) -> bytes:
    """A record's fields after its sequence, step and times, packed once for a collective
    issued again and again alike (`FlightLog.append_fixed` writes the rest)."""
    whole = RECORD.pack(0, 0, 0.0, 0.0, group, op, STATE_ISSUED, dtype, shape, b"", site, -1, size)
    return whole[RECORD_HEAD.size :]


class ReductionRecord(FixedRecord):
    """DDP's gradient all-reduce of one step as one flight-log record, while DDP keeps its C++
    all-reduce: issued when this rank's backward starts, completed when DDP has reduced every
    bucket. Two Python calls a step instead of a hook, a callback and a record per bucket (the
    per-bucket path was most of what the Monitor cost); a rank that never reached backward
    while its peers wait in it is named all the same. Buckets one by one are the backend's
    Flight Recorder's to show, where it keeps one (`watchdog.flight_recorder`)."""

    def __init__(self, log: FlightLog, ddp: torch.nn.Module) -> None:
        grads = [p for p in ddp.module.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in grads)
        dtype = str(grads[0].dtype).removeprefix("torch.") if grads else ""
        site = f"DDP gradients ({len(grads)} tensors, C++ buckets)"
        super().__init__(log, getattr(ddp, "process_group", None), "all_reduce", dtype, str(numel), site)

    def end(self, slot: int) -> None:
        """Every bucket is reduced (a sum from `start_sum` completes through its Work)."""
        self.log.reduction_done(slot)


def start_sum(group: Any, tensor: torch.Tensor, site: str, step: int | None = None) -> Any:
    """All-reduce (sum) `tensor` in place on `group` without waiting: the Work. For a sum
    meshscope issues every window from one place: straight on the process group (the
    `torch.distributed` wrapper's checks cost more than gloo's launch) with a `FixedRecord`
    kept per (group, shape, dtype, site), so the flight log still shows it. `step`: the
    training step the sum belongs to, when the service thread issues it after that step."""
    log = FlightLog._active
    if log is None:
        return group.allreduce([tensor])
    key = (id(group), tuple(tensor.shape), tensor.dtype, site)
    record = log.fixed.get(key)
    if record is None:
        shape = "x".join(map(str, tensor.shape)) or "scalar"
        dtype = str(tensor.dtype).removeprefix("torch.")
        record = log.fixed[key] = FixedRecord(log, group, "all_reduce", dtype, shape, site)
    slot = record.begin(step)
    try:
        work = group.allreduce([tensor])
    except BaseException as err:
        log.finish(slot, err)
        raise
    log.enqueued(slot, work)
    return work
