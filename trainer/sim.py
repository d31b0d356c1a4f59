"""A simulated accelerator on the CPU: the device semantics meshscope must hold on, without a GPU.

On NCCL and HCCL a collective *returns* when its kernel is enqueued; its future is complete
at once; the data moves later on the device's stream; an event completes when the stream gets
there; a host that reads a device value waits (a sync). gloo does none of this, so code proven
on gloo alone can take enqueue for completion. The sim gives a CPU run those semantics:

- `SimStream`: one thread per process, the device's stream. Collectives and events run on it
  in the order they were enqueued; its queue is bounded like a launch queue, so a host that
  runs ahead of a stuck stream blocks in the next launch, as it does on a real device.
  `hang()` makes it stop (a transport or device fault: the rank's kernel never finishes).
- `SimEvent`, `SimAccelerator`: the `torch.cuda` / `torch.npu` names meshscope uses, and only
  those (a name the real module lacks is an AttributeError).
- `SimProcessGroup`: the backends `simnccl` and `simhccl`, registered with
  `torch.distributed.Backend.register_backend` and built on gloo. Each collective is checked as
  the real library checks it (tensors on the group's device, dense; `simhccl` refuses float64
  reductions, as HcclAllReduce's dtype table does), enqueued on the stream, and answered with
  a `Work` whose future is already complete. `Work.wait()` makes the "current stream" wait for
  it: here the host is the compute stream, so the host waits. `Work.is_completed()` says
  whether the stream has run it, without waiting (NCCL queries its end event the same way).
  Errors follow `WorkNCCL` too: a failed collective is *completed*, its `get_future_result()`
  says `COMM_ERROR`, and `is_success()` is refused (`SimWork` cites the source).
- Coalescing (`_coalescing_manager(group, device)`): the block's ops launch together at its
  end with one end event; each op's own Work queries as complete at once, as NCCL's does
  (its end event is never recorded). `batch_isend_irecv` coalesces only a group whose type is
  exactly `ProcessGroup` and a Python backend cannot be one, so on the sim it issues its ops
  one by one; a two-way exchange of two ranks there waits on itself (use the manager).
- The current device is per thread, and a thread's first device call makes a "context" on
  it (`contexts()`), as CUDA does on a new thread's device 0.

The sim's device is the host, so it cannot tell a host tensor from a device one: its device
type is "cpu". What it proves is ordering and completion, not placement (the refusal of host
tensors by a real accelerator group is tested with gloo's `cuda:gloo` groups).

Nor does it order the host's own arithmetic after a collective: on a device, a kernel enqueued
after DDP's all-reduce runs after it (DDP's future makes the compute stream wait); here the
host runs it at once, so a value read from a bucket before a `Work.wait()` (or a synchronous
collective, which waits for everything enqueued before it) may predate the reduction. Training
numbers are compared on gloo, or read after such a wait.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import WorkResult

from meshscope.collector.probe import host_rss_bytes

SIM_BACKENDS = ("simnccl", "simhccl")
LAUNCH_QUEUE = 256  # kernels a host may run ahead of its stream before a launch blocks
# HcclAllReduce / HcclReduce / HcclReduceScatter dtypes on Atlas A2/A3 (training parts lack
# int16 and bf16); float64 reductions are refused everywhere.
HCCL_REDUCE_DTYPES = frozenset(
    {torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.bfloat16}
)


class SimStream:
    """The device stream of this process: work runs in enqueue order on one thread."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Callable[[], None], threading.Event]] = queue.Queue(LAUNCH_QUEUE)
        self._hung = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshscope-sim-stream", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            work, done = self._queue.get()
            while self._hung.is_set():  # a stuck kernel: nothing after it runs either
                time.sleep(3600)
            try:
                work()
            finally:
                done.set()

    def enqueue(self, work: Callable[[], None]) -> threading.Event:
        """Launch `work` on the stream; blocks only when the launch queue is full."""
        done = threading.Event()
        self._queue.put((work, done))
        return done

    def hang(self) -> None:
        """From the next kernel on, the stream never advances (a transport or device fault)."""
        self._hung.set()

    def synchronize(self) -> None:
        """Wait until everything enqueued so far has run."""
        self.enqueue(lambda: None).wait()


_stream: SimStream | None = None
_stream_lock = threading.Lock()


def stream() -> SimStream:
    """This process's sim stream (made on first use; a forked child makes its own)."""
    global _stream
    with _stream_lock:
        if _stream is None or not _stream._thread.is_alive():
            _stream = SimStream()
        return _stream


class SimEvent:
    """`torch.cuda.Event` on the sim stream: complete when the stream has passed it."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self._done: threading.Event | None = None
        self._at = 0.0

    def record(self, stream_: Any = None) -> None:
        """Enqueue this event on the stream."""

        def reached() -> None:
            self._at = time.perf_counter()

        SIM._touch()
        self._done = stream().enqueue(reached)

    def query(self) -> bool:
        """Whether the stream has passed it (never blocks; an unrecorded event is complete,
        as cudaEventQuery says of one)."""
        SIM._touch()
        return self._done is None or self._done.is_set()

    def synchronize(self) -> None:
        """Block the host until the stream has passed it."""
        if self._done is not None:
            self._done.wait()

    def elapsed_time(self, end: SimEvent) -> float:
        """Milliseconds between two completed events (as CUDA's, an error if either is not)."""
        if not (self.query() and end.query()) or self._done is None or end._done is None:
            raise RuntimeError("elapsed_time: both events must be recorded and completed")
        return (end._at - self._at) * 1000.0


class SimAccelerator:
    """The subset of `torch.cuda` / `torch.npu` that meshscope calls, on the sim stream.

    A plain class: a name torch's device modules lack is an AttributeError here too. Device
    memory is the process's memory above what it held when the sim started (the sim's device
    is the host), so a leak shows as device memory that grows."""

    Event = SimEvent

    def __init__(self, count: int = 1) -> None:
        self._count = count
        self._local = threading.local()  # the current device is per thread, as CUDA's
        self._base = host_rss_bytes()
        # Devices this process made a context on: CUDA makes one (~0.5 GiB) on a thread's
        # current device at its first call there, and a new thread's current device is 0.
        self._contexts: set[int] = set()

    def _touch(self) -> None:
        """A call that needs a context on the calling thread's current device."""
        self._contexts.add(self.current_device())

    def is_available(self) -> bool:
        """A sim device is always there."""
        return True

    def is_initialized(self) -> bool:
        """Whether the stream thread runs."""
        return _stream is not None

    def device_count(self) -> int:
        """How many sim devices this host shows."""
        return self._count

    def set_device(self, device: Any) -> None:
        """Bind to a device index (one stream serves every index)."""
        index = device.index if isinstance(device, torch.device) else int(device)
        if not 0 <= (index or 0) < self._count:
            raise RuntimeError(f"set_device: invalid device ordinal {index} (have {self._count})")
        self._local.index = index or 0
        self._contexts.add(self._local.index)

    def current_device(self) -> int:
        """The calling thread's device (0 on a thread that never set one)."""
        return getattr(self._local, "index", 0)

    def synchronize(self, device: Any = None) -> None:
        """Block the host until the stream is empty."""
        self._touch()
        stream().synchronize()

    def memory_allocated(self, device: Any = None) -> int:
        """Bytes the process holds above its start (the device is the host)."""
        return max(0, host_rss_bytes() - self._base)

    def memory_reserved(self, device: Any = None) -> int:
        """As allocated: the host has no caching allocator to reserve ahead."""
        return self.memory_allocated(device)


SIM = SimAccelerator(count=64)  # as many sim devices as ranks on a test host


def contexts() -> set[int]:
    """The sim devices this process made a context on (what CUDA would hold memory on)."""
    return set(SIM._contexts)


def forget_contexts() -> None:
    """Start counting contexts afresh (a check that binds a device first)."""
    SIM._contexts.clear()


_PASSED = threading.Event()  # what an unrecorded CUDA event is: passed
_PASSED.set()


# --- the process groups -------------------------------------------------------------------------


class SimWork(dist.Work):
    """A collective on the sim stream, answering as `WorkNCCL` does (ProcessGroupNCCL.cpp):
    its future is complete at once (it says "enqueued"); `is_completed()` is
    `exception() || finishedGPUExecutionInternal()`, so a failed collective is completed too;
    `get_future_result()` turns `COMM_ERROR` when it failed (`checkAndSetException`) and
    `SUCCESS` once it ran (the watchdog's mark); `isSuccess()` throws ("deprecated")."""

    def __init__(
        self,
        done: threading.Event,
        result: list[torch.Tensor],
        errors: list[BaseException],
        outcome: torch.futures.Future,
    ) -> None:
        super().__init__()
        self._done, self._errors, self._outcome = done, errors, outcome
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """The current stream (the host, here) waits for the collective."""
        seconds = timeout.total_seconds() if timeout else None
        if not self._done.wait(seconds or None):
            raise RuntimeError("simnccl: Work.wait timed out")
        if self._errors:
            raise self._errors[0]
        return True

    def get_future(self) -> torch.futures.Future:
        """Complete already: it says the collective was enqueued, not that it ran."""
        return self._future

    def get_future_result(self) -> torch.futures.Future:
        """The `WorkResult` once known (an int, as NCCL's future holds it)."""
        return self._outcome

    def is_completed(self) -> bool:
        """Whether the stream has run it, or it failed (never blocks; a query of its end
        event, a call on the calling thread's device)."""
        SIM._touch()
        return self._done.is_set() or self._outcome.done()  # an outcome is known once it ran or failed

    def exception(self) -> BaseException | None:
        """The error it met (c10d's `Work::exception`, which NCCL keeps)."""
        return self._errors[0] if self._errors else None

    def is_success(self) -> bool:
        """NCCL refuses the question; so does the sim."""
        raise NotImplementedError("WorkNCCL::isSuccess() is deprecated")


class SimProcessGroup(dist.ProcessGroup):
    """NCCL (or HCCL) semantics over a gloo group: see the module doc."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta, flavour: str) -> None:
        super().__init__(rank, size)
        self.flavour = flavour
        self.device_type = "cpu"
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore(f"{flavour}/", store), rank, size, timeout)
        self._block: list[Callable[[], Any]] | None = None  # ops of an open coalescing block

    def getBackendName(self) -> str:  # noqa: N802  (c10d's name)
        """The backend's name, as c10d asks for it."""
        return self.flavour

    # --- checks the real libraries make ----------------------------------------------------
    def _check(self, op: str, tensors: list[torch.Tensor], reduces: bool = False) -> None:
        for t in tensors:
            if t.device.type != self.device_type or t.layout != torch.strided:
                raise ValueError(f"{self.flavour} {op}: Tensors must be {self.device_type} and dense")
            if reduces and self.flavour == "simhccl" and t.dtype not in HCCL_REDUCE_DTYPES:
                raise RuntimeError(
                    f"{self.flavour} {op}: HCCL does not support {str(t.dtype).removeprefix('torch.')} "
                    "reductions (HcclAllReduce takes int8/16/32/64, fp16, fp32, bf16)"
                )

    def _launch(self, run: Callable[[], Any], result: list[torch.Tensor]) -> SimWork:
        if self._block is not None:  # launched with the block (`_end_coalescing`)
            self._block.append(run)
            # NCCL does not record a coalesced op's end event, and an unrecorded event
            # queries as complete: the op's own Work says "completed" before it launched.
            return SimWork(_PASSED, result, [], torch.futures.Future())
        return self._enqueue([run], result)

    def _enqueue(self, runs: list[Callable[[], Any]], result: list[torch.Tensor]) -> SimWork:
        errors: list[BaseException] = []
        outcome: torch.futures.Future = torch.futures.Future()

        def on_stream() -> None:
            try:
                for work in [run() for run in runs]:  # a block's ops start together
                    work.wait()
            except BaseException as err:  # noqa: BLE001  (the Work reports it)
                errors.append(err)
            outcome.set_result(int(WorkResult.COMM_ERROR if errors else WorkResult.SUCCESS))

        return SimWork(stream().enqueue(on_stream), result, errors, outcome)

    # --- coalescing (`_coalescing_manager(group, device)`): one launch, one end event ----------
    def _start_coalescing(self, device: Any) -> None:
        """Ops from here to `_end_coalescing` launch together (ncclGroupStart)."""
        self._block = []

    def _end_coalescing(self, device: Any) -> SimWork:
        """Launch the block; its Work completes when every op in it ran (ncclGroupEnd)."""
        runs, self._block = self._block or [], None
        return self._enqueue(runs, [])

    # --- collectives (c10d's signatures) ------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        """All-reduce, as NCCL does it: enqueued now, reduced on the stream."""
        self._check("allreduce", tensors, reduces=True)
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._launch(lambda: self._gloo.allreduce(tensors, opts), tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        """Several all-reduces as one launch."""
        self._check("allreduce_coalesced", tensors, reduces=True)
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._launch(lambda: self._gloo.allreduce_coalesced(tensors, opts), tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        """Broadcast from `opts.rootRank`."""
        self._check("broadcast", tensors)
        return self._launch(lambda: self._gloo.broadcast(tensors, opts), tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        """Reduce to `opts.rootRank`."""
        self._check("reduce", tensors, reduces=True)
        return self._launch(lambda: self._gloo.reduce(tensors, opts), tensors)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> SimWork:
        """All-gather into lists of tensors."""
        self._check("allgather", inputs + [t for out in outputs for t in out])
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._launch(
            lambda: self._gloo.allgather(outputs, inputs, opts), [t for o in outputs for t in o]
        )

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimWork:
        """All-gather into one tensor."""
        self._check("allgather_into_tensor", [output, input])
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._launch(lambda: self._gloo._allgather_base(output, input, opts), [output])

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> SimWork:
        """Reduce-scatter from lists of tensors."""
        self._check("reduce_scatter", outputs + [t for i in inputs for t in i], reduces=True)
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._launch(lambda: self._gloo.reduce_scatter(outputs, inputs, opts), outputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimWork:
        """Reduce-scatter from one tensor."""
        self._check("reduce_scatter_tensor", [output, input], reduces=True)
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._launch(lambda: self._gloo._reduce_scatter_base(output, input, opts), [output])

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        opts: Any = None,
    ) -> SimWork:
        """all_to_all_single."""
        self._check("all_to_all_single", [output, input])
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._launch(
            lambda: self._gloo.alltoall_base(output, input, out_splits, in_splits, opts), [output]
        )

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> SimWork:
        """all_to_all of tensor lists."""
        self._check("all_to_all", outputs + inputs)
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._launch(lambda: self._gloo.alltoall(outputs, inputs, opts), outputs)

    def gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> SimWork:
        """Gather to `opts.rootRank`."""
        self._check("gather", inputs)
        return self._launch(lambda: self._gloo.gather(outputs, inputs, opts), inputs)

    def scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> SimWork:
        """Scatter from `opts.rootRank`."""
        self._check("scatter", outputs)
        return self._launch(lambda: self._gloo.scatter(outputs, inputs, opts), outputs)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> SimWork:
        """Point-to-point send."""
        self._check("send", tensors)
        return self._launch(lambda: self._gloo.send(tensors, dst, tag), tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> SimWork:
        """Point-to-point receive."""
        self._check("recv", tensors)
        return self._launch(lambda: self._gloo.recv(tensors, src, tag), tensors)

    _allgather_base = all_gather_single  # c10d's older names, still called by some paths
    _reduce_scatter_base = reduce_scatter_single
    alltoall_base = all_to_all_single

    def barrier(self, opts: Any = None) -> SimWork:
        """A barrier on the stream (NCCL's is an all-reduce of one element)."""
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._launch(lambda: self._gloo.barrier(opts), [])


def register_backends() -> None:
    """Make `simnccl` and `simhccl` known to torch.distributed (once per process)."""
    for name in SIM_BACKENDS:
        if hasattr(dist.Backend, name.upper()):
            continue

        def create(
            store: Any, rank: int, size: int, timeout: timedelta, _name: str = name
        ) -> SimProcessGroup:
            return SimProcessGroup(store, rank, size, timeout, _name)

        dist.Backend.register_backend(name, create, devices=["cpu"])
