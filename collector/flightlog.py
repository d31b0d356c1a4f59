"""The collective flight log: what every rank was doing on the wire, readable after it died.

Each rank keeps a ring of fixed-size records in a memory-mapped file,
`<run>/live/rank<R>-<pid>.flight`: one record per collective meshscope can see (DDP buckets
through the comm hook, the control plane, and the `torch.distributed` calls of user code),
with the sequence number per process group, op, shapes, dtype, split sizes, state
(issued/completed/failed), times, training step and the Python call site. The mapping lives
in the page cache, so the records of a rank killed by SIGKILL or aborted inside gloo are still
there for the hang watchdog (`meshscope.watchdog`), which reads the files from beside the job and
never through the process group that is stuck.

Beside the ring, a responder thread answers the watchdog's requests for Python stacks
(`sys._current_frames`), and faulthandler writes the stacks of a crash to `<...>.crash`
(`collector.stacks`). The format and the reader are in `collector.flightread`.

"Completed" means the device finished it. On the host (gloo on CPU) that is when the call
returns or its future completes. On an accelerator both happen as soon as the kernel is
enqueued (NCCL's `Work.get_future()` only says the work was enqueued), so there the log is
given the Monitor's device probe and keeps device truth on a thread of its own: an async
collective is completed when its `Work.is_completed()` says so (NCCL and HCCL query the
work's end event; no wait), a blocking one when an event recorded after it in stream order
has passed, and progress is the device's: the last step whose end event completed, with the
time it did. A rank whose host is blocked in a kernel launch behind a stuck stream thus still
says where its device is. Nothing here synchronises the device.

Collectives are seen by wrapping the `torch.distributed` functions and the functional
collectives once per process (`FlightLog.install`, `collector.flightwrap`: a coalescing block's
ops complete with the block, a functional collective when its result is waited for). Code
that imported a function by name before that (`from torch.distributed import all_reduce`) is
not seen. DDP's C++ all-reduce is seen as one record
per step (`flightfixed.ReductionRecord`: issued as backward starts, completed once every bucket
is reduced), so DDP keeps its C++ path; a Python comm hook (compression, injected faults) records
each bucket (`allreduce_hook`, `issue_bucket`).
"""

from __future__ import annotations

import faulthandler
import functools
import json
import mmap
import os
import re
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshscope.collector import flightwrap
from meshscope.collector.devicetruth import DeviceTruth
from meshscope.collector.flightops import OPS, RECORDED_AS, Op, arg_of, call_site, split_sizes, tensors_of
from meshscope.collector.flightread import (
    CLOCK_DEVICE,
    CLOCK_OFFSET,
    CLOSED,
    ERROR_OFFSET,
    HEADER_SIZE,
    PROGRESS_OFFSET,
    RECORD,
    RECORD_HEAD,
    STATE_DONE,
    STATE_FAILED,
    STATE_HDR_OFFSET,
    STATE_ISSUED,
    STATE_OFFSET,
    STOPPING,
    T_DONE_OFFSET,
    WRITTEN_OFFSET,
    fit,
    flight_path,
    groups_path,
    write_header,
)
from meshscope.collector.flightsteps import StepMarks
from meshscope.collector.native import fast as _fast
from meshscope.collector.stacks import (
    StackResponder,
    crash_path,
    recorder_dump,
    write_recorder_dump,
    write_stacks,
)

_INT64 = struct.Struct("<q")

# --- the log ----------------------------------------------------------------------------


class FlightLog(StepMarks):
    """One rank's ring of collective records in a memory-mapped file (see the module doc)."""

    _active: FlightLog | None = None
    _originals: dict[str, Callable[..., Any]] = {}

    def __init__(
        self,
        folder: Path,
        *,
        rank: int,
        world_size: int,
        capacity: int = 2048,
        attempt: int = 0,
        probe: Any = None,
        device_poll_s: float = 0.02,
    ) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rank, self.world, self.capacity = rank, world_size, capacity
        self.pid = os.getpid()
        self.path = flight_path(self.folder, rank, self.pid)
        size = HEADER_SIZE + capacity * RECORD.size
        with open(self.path, "wb") as f:
            f.truncate(size)
        self._file = open(self.path, "r+b")
        self._map = mmap.mmap(self._file.fileno(), size)
        write_header(self._map, rank, world_size, self.pid, capacity, attempt)
        self._written = 0
        self._seq: dict[str, int] = {}
        self._groups: dict[int, tuple[str, int]] = {}
        self._host_groups: set[str] = set()
        self._host_slots: set[int] = set()  # records of host groups awaiting `enqueued`
        self._polled: list[tuple[int, Any]] = []  # works with no future (`settle_polled`)
        self.block: flightwrap.Block | None = None  # an open coalescing block (`flightwrap`)
        self._group_ranks: dict[str, list[int]] = {}
        self._buckets: dict[tuple[int, int, int], tuple] = {}  # (group, index, numel) -> packed
        self.fixed: dict[tuple, Any] = {}  # `flightfixed.start_sum`'s records, packed once
        # every sequence number is taken under it; C's own where built, which C takes without a
        # call on the training thread (`collector/csrc/lock.c`)
        self._lock = _fast.Lock() if _fast is not None else threading.Lock()
        self._step_started, self._step_s = 0.0, 0.0  # the step itself: the header's (`step`)
        # host step ends the training thread queued: (step, took, at, reduced slots, written)
        self._ends: deque[tuple[int, float, float, Any]] = deque()
        # records C issued on the training thread for the drain to write (`StepMarks.write_opens`)
        self._opens: deque[tuple[str, int, bytes, int, float]] = deque()
        self._opened: dict[tuple[str, int], tuple[int, int]] = {}  # (name, seq) -> (slot, index)
        # one writer of what was queued at a time, in queue order: the drain's round, or a
        # stacks request that must not wait for it (`settle_ends`)
        self._settling = threading.Lock()
        self.defer_ends = False  # True: a service calls `settle_ends` (the Monitor's drain)
        self._crash_file = None
        self._responder: StackResponder | None = None
        self._recorder: Callable[[], bytes] | None = None
        self._device: DeviceTruth | None = None
        if probe is not None and getattr(probe, "asynchronous", False):
            struct.pack_into("<i", self._map, CLOCK_OFFSET, CLOCK_DEVICE)
            self._device = DeviceTruth(self, probe, device_poll_s).start()

    # --- records ------------------------------------------------------------------------
    def group_of(self, group: Any) -> tuple[str, int]:
        """A process group's name and size, as records carry them (its ranks written once)."""
        key = id(group)
        known = self._groups.get(key)
        if known is None:
            pg = group if group is not None else dist.distributed_c10d._get_default_group()
            name = dist.distributed_c10d._get_process_group_name(pg)
            ranks = dist.get_process_group_ranks(pg)
            known = self._groups[key] = (name, len(ranks))
            self._group_ranks[name] = ranks
            if dist.get_backend(pg) == "gloo":  # gloo completes on the host, whatever the device
                self._host_groups.add(name)
            self._write_groups()
        return known

    def _write_groups(self) -> None:
        tmp = self.path.with_suffix(".groups.tmp")
        tmp.write_text(json.dumps(self._group_ranks))
        os.replace(tmp, groups_path(self.path))

    def issue(self, op: str, spec: Op, args: tuple, kwargs: dict, frame: Any) -> int:
        """Record a collective as issued; returns its slot for `finish`."""
        group, size = self.group_of(arg_of(args, kwargs, *spec.group))
        tensors = [t for i, name in spec.tensors for t in tensors_of(arg_of(args, kwargs, i, name))]
        shapes = ";".join("x".join(map(str, t.shape)) or "scalar" for t in tensors)
        dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else ""
        peer = arg_of(args, kwargs, *spec.peer) if spec.peer else None
        splits = split_sizes(args, kwargs) if spec.splits else ""
        counter = f"{group}/p2p" if spec.p2p else group
        with self._lock:
            seq = self._seq.get(counter, 0)
            self._seq[counter] = seq + 1
            slot = self._written % self.capacity
            # every thread's collectives carry the step: a comm hook's second phase runs on a
            # callback thread and belongs to the step; a background checkpoint's does not, and
            # the diagnosis tells the two apart (see watchdog.diagnose)
            RECORD.pack_into(
                self._map,
                HEADER_SIZE + slot * RECORD.size,
                seq,
                self.step,
                time.time(),
                0.0,
                fit(group, 16),
                fit(op, 24),
                STATE_ISSUED,
                fit(dtype, 15),
                fit(shapes, 56),
                fit(splits, 56),
                fit(call_site(frame), 96),
                -1 if peer is None else int(peer),
                size,
            )
            self._written += 1
            struct.pack_into("<q", self._map, WRITTEN_OFFSET, self._written)
            if group in self._host_groups:
                self._host_slots.add(slot)
        return slot

    def issue_bucket(self, group: Any, bucket: Any) -> int:
        """Record a DDP bucket's all-reduce as issued: the fast path of `issue`, one per bucket
        per step, with the bucket's fields packed once (its shape and dtype never change)."""
        buffer = bucket.buffer()
        key = (id(group), bucket.index(), buffer.numel())  # DDP rebuilds its buckets once: new fields
        fields = self._buckets.get(key)
        if fields is None:
            name, size = self.group_of(group)
            dtype = str(buffer.dtype).removeprefix("torch.")
            site = f"DDP bucket {bucket.index()} ({len(bucket.gradients())} grads)"
            packed = (fit("all_reduce", 24), fit(dtype, 15), fit(str(buffer.numel()), 56), fit(site, 96))
            fields = self._buckets[key] = (name, fit(name, 16), size, packed)
        name, group_bytes, size, (op, dtype, shape, site) = fields
        return self.append(name, group_bytes, size, op, dtype, shape, site)

    def append(
        self,
        name: str,
        group: bytes,
        size: int,
        op: bytes,
        dtype: bytes,
        shape: bytes,
        site: bytes,
        step: int | None = None,
    ) -> int:
        """A record of packed fields, issued now, numbered in `name`'s sequence: its slot.
        `step`: the training step it belongs to, when another thread issues it later."""
        with self._lock:
            seq = self._seq.get(name, 0)
            self._seq[name] = seq + 1
            slot = self._written % self.capacity
            RECORD.pack_into(
                self._map,
                HEADER_SIZE + slot * RECORD.size,
                *(seq, self.step if step is None else step, time.time(), 0.0, group, op, STATE_ISSUED),
                *(dtype, shape, b""),
                *(site, -1, size),
            )
            self._written += 1
            struct.pack_into("<q", self._map, WRITTEN_OFFSET, self._written)
            if name in self._host_groups:
                self._host_slots.add(slot)
        return slot

    def append_fixed(self, name: str, tail: bytes, step: int | None = None) -> int:
        """`append` for a record whose other fields are packed already
        (`flightfixed.fixed_tail`): its slot. In C where built (`collector/csrc/`)."""
        if _fast is not None:
            return _fast.append_fixed(self, name, tail, step)
        with self._lock:
            seq = self._seq.get(name, 0)
            self._seq[name] = seq + 1
            return self._put(name, tail, seq, self.step if step is None else step, time.time())

    def _put(self, name: str, tail: bytes, seq: int, step: int, issued: float) -> int:
        """A fixed record numbered `seq` of `name` into the next slot, under `_lock`: its slot."""
        slot = self._written % self.capacity
        base = HEADER_SIZE + slot * RECORD.size
        self._map[base + RECORD_HEAD.size : base + RECORD.size] = tail
        RECORD_HEAD.pack_into(self._map, base, seq, step, issued, 0.0)
        self._written += 1
        _INT64.pack_into(self._map, WRITTEN_OFFSET, self._written)
        if name in self._host_groups:
            self._host_slots.add(slot)
        return slot

    def reduction_done(self, slot: int, at: float | None = None) -> None:
        """DDP reduced every bucket of the step: done now (or `at`) on the host; on a device,
        when an event recorded after DDP's wait passes (DDP made the stream wait for its
        buckets)."""
        host = slot in self._host_slots
        self._host_slots.discard(slot)
        if self._device is not None and not host:
            self._device.watch(slot, None)
        else:
            self.finish(slot, at=at)

    def bucket_enqueued(self, slot: int, work: Any) -> torch.futures.Future:
        """The future DDP waits on for a bucket: the reduced buffer, and the record completed
        when the data arrived (on a device: when the device says so, see the module doc)."""
        host = slot in self._host_slots
        self._host_slots.discard(slot)
        if self._device is not None and not host:
            self._device.watch(slot, work)
            return work.get_future().then(_first_value)
        return work.get_future().then(functools.partial(_bucket_done, self, slot))

    def finish(self, slot: int, error: BaseException | None = None, at: float | None = None) -> None:
        """Mark a record completed (or failed) now (or `at`), and the rank as making progress."""
        base = HEADER_SIZE + slot * RECORD.size
        now = time.time() if at is None else at
        struct.pack_into("<d", self._map, base + T_DONE_OFFSET, now)
        struct.pack_into("<b", self._map, base + STATE_OFFSET, STATE_DONE if error is None else STATE_FAILED)
        if error is None:
            struct.pack_into("<d", self._map, PROGRESS_OFFSET, now)
        else:
            self.note_error(error)

    def enqueued(self, slot: int, result: Any) -> None:
        """The call returned: on the host that is completion (or its future's); on a device the
        device thread decides (see the module doc). Inside a coalescing block the call is
        not the collective: the op waits for the block (`flightwrap`)."""
        if self.block is not None and self.block.holds():
            self.block.slots.append(slot)
            return
        host = slot in self._host_slots
        self._host_slots.discard(slot)
        if self._device is not None and not (host and result is None):
            self._device.watch(slot, result)
        elif result is None or not hasattr(result, "get_future"):
            self.finish(slot)
        else:  # async: completed when its future is (gloo: the data arrived)
            try:
                future = result.get_future()
            except RuntimeError:  # gloo's send/recv work has none: asked at the next call
                self._polled.append((slot, result))
                return
            future.add_done_callback(functools.partial(_done, self, slot))

    def settle_polled(self) -> None:
        """Works without a future (gloo's isend/irecv) are finished once they say they
        completed: asked at every call this log records and at every step's end."""
        waiting = self._polled[:]  # the list itself stays: C keeps it (`collector/csrc/`)
        self._polled.clear()
        for slot, work in waiting:
            try:
                done = work.is_completed()
            except RuntimeError as err:  # it failed
                self.finish(slot, err)
                continue
            if done:
                self.finish(slot)
            else:
                self._polled.append((slot, work))

    def note_error(self, error: BaseException) -> None:
        """Keep the first error this rank met (a failed collective, or what ended the worker)."""
        if self._map[ERROR_OFFSET] == 0:
            # gloo prefixes its source path: "[/__w/.../pair.cc:537] Read error ..."
            text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip())
            struct.pack_into("128s", self._map, ERROR_OFFSET, fit(f"{type(error).__name__}: {text}", 127))

    # --- wrapping torch.distributed ---------------------------------------------------------
    def install(self) -> FlightLog:
        """Make this the process's flight log and wrap torch.distributed's collectives once
        (`collector.flightwrap`: what PyTorch compares by identity keeps passing its checks,
        and a coalescing block's ops complete with the block)."""
        FlightLog._active = self
        flightwrap.wrap(OPS, FlightLog.active, FlightLog._originals, RECORDED_AS)
        return self

    @classmethod
    def active(cls) -> FlightLog | None:
        """The process's flight log, if one is installed."""
        return cls._active

    @classmethod
    def uninstall(cls) -> None:
        """Put torch.distributed's functions back (tests)."""
        flightwrap.unwrap(cls._originals)
        cls._active = None

    # --- the watchdog's side -----------------------------------------------------------------
    def start_responder(self, poll_s: float = 0.2) -> FlightLog:
        """Answer stack requests from the watchdog; write a crash's stacks with faulthandler
        (the protocol: `collector.stacks`)."""
        self._recorder = recorder_dump()  # the backend's own Flight Recorder, if it keeps one
        self._crash_file = open(crash_path(self.path), "w")
        self._faulthandler_was_on = faulthandler.is_enabled()
        faulthandler.enable(file=self._crash_file, all_threads=True)
        self._responder = StackResponder(self.folder, self.write_stacks, poll_s).start()
        return self

    def write_stacks(self, request_id: str = "") -> Path:
        """Every thread's Python stack, the main thread first, for the watchdog; and the
        backend's Flight Recorder where it keeps one. The records and step ends the training
        thread queued are written first: the tails the watchdog reads after its request are
        as fresh as the request, whatever the drain's cadence."""
        self.settle_ends()
        if self._recorder is not None:
            write_recorder_dump(self.path, request_id, self._recorder)
        return write_stacks(self.path, request_id, self.step)

    def stopping(self) -> None:
        """Told to stop (SIGTERM from its agent or the user): a stall on the way out, or an
        end before `close`, is a departure, not a hang or a crash (safe in a signal handler)."""
        struct.pack_into("<i", self._map, STATE_HDR_OFFSET, STOPPING)

    def close(self) -> None:
        """A clean exit: the watchdog must not take this rank for dead."""
        self.settle_polled()
        self.settle_ends()
        if self._responder is not None:
            self._responder.stop(wait=False)  # asleep in the kernel: it ends when it wakes
        if self._device is not None:
            self._device.stop()
        struct.pack_into("<i", self._map, STATE_HDR_OFFSET, CLOSED)
        if FlightLog._active is self:
            FlightLog._active = None
        if self._crash_file is not None:
            faulthandler.disable()
            if self._faulthandler_was_on:  # give the process its crash reports back
                faulthandler.enable()
            self._crash_file.close()
            self._crash_file = None
        self._map.flush()


def _done(log: FlightLog, slot: int, fut: Any) -> None:
    try:
        fut.wait()
    except Exception as err:  # the collective failed; the failure is the record
        log.finish(slot, err)
        return
    log.finish(slot)


def _first_value(fut: Any) -> torch.Tensor:
    return fut.value()[0]


def _bucket_done(log: FlightLog, slot: int, fut: Any) -> torch.Tensor:
    try:
        value = fut.value()[0]
    except Exception as err:  # the collective failed; the failure is the record
        log.finish(slot, err)
        raise
    log.finish(slot)
    return value


def allreduce_hook(process_group, bucket):  # noqa: ANN001,ANN201  (DDP checks annotations)
    """DDP's plain all-reduce, issued from Python so the flight log sees every bucket: straight
    to the process group (not through `dist.all_reduce`) and recorded on `issue_bucket`'s fast
    path, so a bucket costs a few Python calls."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    buffer.div_(group.size())
    log = FlightLog._active
    if log is None:
        return group.allreduce([buffer]).get_future().then(_first_value)
    slot = log.issue_bucket(group, bucket)
    try:
        work = group.allreduce([buffer])
    except BaseException as err:
        log.finish(slot, err)
        raise
    return log.bucket_enqueued(slot, work)
