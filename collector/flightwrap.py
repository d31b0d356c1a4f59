"""How the flight log sees `torch.distributed` calls: its functions wrapped once per process,
and PyTorch's coalescing blocks followed to the work that really runs them.

Inside `_coalescing_manager` (and so inside NCCL's `batch_isend_irecv`) a call is not the
collective: `all_reduce` returns None or an `_IllegalWork` whose every method raises, and on
NCCL a `send`/`recv` returns a work whose end event is never recorded ("In coalescing mode,
we don't record the end event per op", ProcessGroupNCCL.cpp), so querying it says completed
before anything launched. The ops of a block therefore wait for the block: completed with
the work the manager hands back (`cm.works`) or, for a blocking block, once it returned.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

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


def wrap(ops: dict[str, Any], active: Callable[[], Any], originals: dict[str, Callable]) -> None:
    """Replace torch.distributed's functions by recording ones (once: `originals` remembers)."""
    for name, spec in ops.items():
        if name in originals or not hasattr(dist, name):
            continue
        original = originals[name] = getattr(dist, name)
        wrapped = logged(name, spec, original, active)
        setattr(dist, name, wrapped)
        if name in IDENTITY_CHECKED and getattr(c10d, name, None) is original:
            setattr(c10d, name, wrapped)
    if COALESCING not in originals and hasattr(c10d, COALESCING):
        original = originals[COALESCING] = getattr(c10d, COALESCING)
        wrapped = coalesced(original, active)
        setattr(c10d, COALESCING, wrapped)
        if getattr(dist, COALESCING, None) is original:
            setattr(dist, COALESCING, wrapped)


def unwrap(originals: dict[str, Callable]) -> None:
    """Put torch.distributed's own functions back."""
    for name, original in originals.items():
        if hasattr(dist, name):
            setattr(dist, name, original)
        if name in IDENTITY_CHECKED or name == COALESCING:
            setattr(c10d, name, original)
    originals.clear()
