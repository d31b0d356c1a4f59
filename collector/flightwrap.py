"""How the flight log sees `torch.distributed` calls: its functions wrapped once per process,
and PyTorch's coalescing blocks followed to the work that really runs them.

Inside `_coalescing_manager` (and so inside NCCL's `batch_isend_irecv`) a call is not the
collective: `all_reduce` returns None or an `_IllegalWork` whose every method raises, and on
NCCL a `send`/`recv` returns a work whose end event is never recorded ("In coalescing mode,
we don't record the end event per op", ProcessGroupNCCL.cpp), so querying it says completed
before anything launched. The ops of a block therefore wait for the block: completed with
the work the manager hands back (`cm.works`) or, for a blocking block, once it returned.

Functional collectives (`torch.distributed._functional_collectives`: DTensor's redistributions,
tensor parallelism) return an `AsyncCollectiveTensor` whose data is there once `wait_tensor`
ran on it (at its first use): a record is issued by the call and enqueued at that wait. Inside
`torch.compile` they are left alone (a traced call must not write a file).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

from meshscope.collector.flightops import Op, arg_of

# Compared by identity inside torch (P2POp, batch_isend_irecv): wrapped in its own module too.
IDENTITY_CHECKED = ("isend", "irecv")
# Called by name from inside distributed_c10d (batch_isend_irecv): wrapped in both namespaces.
COALESCING = "_coalescing_manager"


class Block:
    """The records issued inside one coalescing block, on the thread that opened it."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.slots: list[int] = []

    def holds(self) -> bool:
        """Whether a call on this thread is one of the block's ops."""
        return threading.get_ident() == self.thread


def logged(name: str, spec: Any, original: Callable[..., Any], active: Callable[[], Any]) -> Callable:
    """`original` recorded in the active log: issued, then enqueued with what it returned."""

    @functools.wraps(original)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        log = active()
        if log is None:
            return original(*args, **kwargs)
        if log._polled:
            log.settle_polled()
        slot = log.issue(name, spec, args, kwargs, sys._getframe(1))
        try:
            result = original(*args, **kwargs)
        except BaseException as err:
            log.finish(slot, err)
            raise
        log.enqueued(slot, result)
        return result

    return recorded


def coalesced(original: Callable[..., Any], active: Callable[[], Any]) -> Callable:
    """`_coalescing_manager` whose ops complete with the block (module doc)."""

    @functools.wraps(original)
    @contextlib.contextmanager
    def coalescing(*args: Any, **kwargs: Any) -> Iterator[Any]:
        log = active()
        if log is None or log.block is not None:  # torch refuses a nested block itself
            with original(*args, **kwargs) as manager:
                yield manager
            return
        log.block = block = Block()
        try:
            with original(*args, **kwargs) as manager:
                yield manager
        except BaseException as err:
            log.block = None
            for slot in block.slots:
                log.finish(slot, err)
            raise
        log.block = None
        works = list(getattr(manager, "works", []))
        for slot in block.slots:
            log.enqueued(slot, works[-1] if works else None)

    return coalescing


# funcol's function -> (the op it is recorded as, where its tensor, group and peer are)
FUNCTIONAL = {
    "all_reduce": ("all_reduce", Op(((0, "self"),), (2, "group"))),
    "all_gather_single": ("all_gather_into_tensor", Op(((0, "self"),), (2, "group"))),
    "reduce_scatter_single": ("reduce_scatter_tensor", Op(((0, "self"),), (3, "group"))),
    "all_to_all_single": ("all_to_all_single", Op(((0, "self"),), (3, "group"))),
    "broadcast": ("broadcast", Op(((0, "self"),), (2, "group"), peer=(1, "src"))),
}
WAIT = "wait_tensor"


class Awaited:
    """Functional collectives issued and not yet waited for: their result tensor -> slot."""

    def __init__(self) -> None:
        self._slots: dict[int, tuple[weakref.ref, int]] = {}

    def add(self, tensor: torch.Tensor, slot: int) -> None:
        """`tensor` holds the collective's result once waited for."""
        self._slots[id(tensor)] = (weakref.ref(tensor), slot)

    def pop(self, tensor: Any) -> int | None:
        """The slot whose result `tensor` is, if any (an id reused by another tensor is not)."""
        held = self._slots.pop(id(tensor), None)
        if held is None or held[0]() is not tensor:
            return None
        return held[1]


AWAITED = Awaited()


def functional(name: str, spec: Op, original: Callable[..., Any], active: Callable[[], Any]) -> Callable:
    """A functional collective recorded as issued; enqueued when its result is waited for."""
    index, key = spec.group

    @functools.wraps(original)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        log = active()
        if log is None or torch.compiler.is_compiling():
            return original(*args, **kwargs)
        group = c10d._resolve_process_group(funcol._resolve_group_name(arg_of(args, kwargs, index, key)))
        call = (*args[:index], group, *args[index + 1 :]) if len(args) > index else args
        slot = log.issue(
            name, spec, call, kwargs | ({key: group} if len(args) <= index else {}), sys._getframe(1)
        )
        try:
            result = original(*args, **kwargs)
        except BaseException as err:
            log.finish(slot, err)
            raise
        if isinstance(result, funcol.AsyncCollectiveTensor):
            AWAITED.add(result.elem, slot)
        else:  # already waited for (traced)
            log.enqueued(slot, None)
        return result

    return recorded


def waited(original: Callable[..., Any], active: Callable[[], Any]) -> Callable:
    """`wait_tensor`: the functional collective whose result it is has arrived on the host (on
    a device, the current stream waits for it: an event after this passes once it ran)."""

    @functools.wraps(original)
    def wait(tensor: Any) -> Any:
        out = original(tensor)
        slot = AWAITED.pop(tensor)
        log = active()
        if slot is not None and log is not None:
            log.enqueued(slot, None)
        return out

    return wait


def wrap_functional(active: Callable[[], Any], originals: dict[str, Callable]) -> None:
    """Record funcol's collectives (once: `originals` remembers, under `funcol.<name>`)."""
    for name, (recorded_as, spec) in FUNCTIONAL.items():
        if f"funcol.{name}" not in originals and hasattr(funcol, name):
            original = originals[f"funcol.{name}"] = getattr(funcol, name)
            setattr(funcol, name, functional(recorded_as, spec, original, active))
    if f"funcol.{WAIT}" not in originals:
        original = originals[f"funcol.{WAIT}"] = getattr(funcol, WAIT)
        setattr(funcol, WAIT, waited(original, active))


def wrap(
    ops: dict[str, Any], active: Callable[[], Any], originals: dict[str, Callable], names: dict[str, str]
) -> None:
    """Replace torch.distributed's functions by recording ones (once: `originals` remembers);
    `names`: the op a function is recorded as, where it is not its own name."""
    for name, spec in ops.items():
        if name in originals or not hasattr(dist, name):
            continue
        original = originals[name] = getattr(dist, name)
        wrapped = logged(names.get(name, name), spec, original, active)
        setattr(dist, name, wrapped)
        if name in IDENTITY_CHECKED and getattr(c10d, name, None) is original:
            setattr(c10d, name, wrapped)
    if COALESCING not in originals and hasattr(c10d, COALESCING):
        original = originals[COALESCING] = getattr(c10d, COALESCING)
        wrapped = coalesced(original, active)
        setattr(c10d, COALESCING, wrapped)
        if getattr(dist, COALESCING, None) is original:
            setattr(dist, COALESCING, wrapped)
    wrap_functional(active, originals)


def unwrap(originals: dict[str, Callable]) -> None:
    """Put torch.distributed's own functions back."""
    for name, original in originals.items():
        if name.startswith("funcol."):
            setattr(funcol, name.removeprefix("funcol."), original)
            continue
        if hasattr(dist, name):
            setattr(dist, name, original)
        if name in IDENTITY_CHECKED or name == COALESCING:
            setattr(c10d, name, original)
    originals.clear()
