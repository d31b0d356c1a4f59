"""Injected faults on the wire: comm hooks that skip, break or delay a gradient collective as a
real fault would (`trainer.inject.Injector` says when), and the wrong split sizes of a router
that miscounts its tokens."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from meshscope.trainer.inject import Injector


def collective_fault_hook(hook: Callable[..., Any], injector: Injector) -> Callable[..., Any]:
    """Wrap a comm hook so skip_collective and collective_mismatch injections happen on the
    wire, where a real one does."""

    def hook_with_faults(state: Any, bucket: Any) -> Any:
        fault = injector.collective_fault()
        if fault is None:
            return hook(state, bucket)
        what, inj = fault
        buffer = bucket.buffer()
        culprit = inj.rank == injector.rank
        if what == "skip":
            done = torch.futures.Future()
            done.set_result(buffer)  # local gradients only, peers wait for this rank
            return done
        if what == "split":
            _exchange_tokens(buffer, wrong=culprit)
            return hook(state, bucket)
        if what == "shape":
            work = dist.all_reduce(torch.cat([buffer, buffer.new_zeros(1)]), async_op=True)
        elif what == "dtype":
            work = dist.all_reduce(buffer.to(torch.float64), async_op=True)
        else:  # op: a broadcast where the peers all-reduce
            work = dist.broadcast(buffer, src=injector.rank, async_op=True)
        return work.get_future().then(lambda fut: buffer)

    return hook_with_faults


def _exchange_tokens(buffer: torch.Tensor, *, wrong: bool) -> None:
    """An expert-parallel style all_to_all_single; the `wrong` rank miscounts what it sends its
    peers (its own share unchanged), as a routing bug would."""
    world, rank = dist.get_world_size(), dist.get_rank()
    send = wrong_splits(rank, world) if wrong else [2] * world
    out = buffer.new_zeros(2 * world)
    dist.all_to_all_single(
        out, buffer.new_ones(sum(send)), output_split_sizes=[2] * world, input_split_sizes=send
    )


def wrong_splits(rank: int, world: int, per_peer: int = 2) -> list[int]:
    """Split sizes off by one towards two peers (one with a single peer): what a router that
    miscounts its tokens sends. Its own share is right, so only the peers can notice."""
    send = [per_peer] * world
    send[(rank + 1) % world] += 1
    if world >= 3:
        send[(rank + 2) % world] -= 1
    return send


def delayed_hook(hook: Callable[..., Any], injector: Injector) -> Callable[..., Any]:
    """Wrap a comm hook so an active comm_delay injection makes each bucket complete late, as a
    slow link does: the step waits for it after backward compute, which is what is measured."""

    def hook_with_delay(state: Any, bucket: Any) -> Any:
        fut = hook(state, bucket)
        delay = injector.comm_delay_s()
        if not delay:
            return fut
        late: torch.futures.Future = torch.futures.Future()

        def arrive_late(f: Any) -> None:
            # A timer, not a sleep in the callback: a callback on an already completed future
            # runs inline, inside backward, and the delay would look like compute.
            try:
                value = f.value()
            except Exception as exc:  # the collective failed: fail late, as it would
                threading.Timer(delay, late.set_exception, args=(exc,)).start()
                return
            threading.Timer(delay, late.set_result, args=(value,)).start()

        fut.add_done_callback(arrive_late)
        return late

    return hook_with_delay
