"""Expert load as the Monitor counts it: tokens each MoE layer's experts received, added up on
the device every forward and summed over ranks once per window of `every` steps.

The sum is the one collective the Monitor adds, and it holds no step: the all-reduce starts as
the step that closes a window ends and is settled as the next step ends, a whole step later,
when it has long finished (on the host gloo's threads carry it meanwhile; on an accelerator the
settle is a stream wait, no host block). Listeners (a trainer's bias update) get the summed
load then, on every rank at the same step, one step after the window closed; the host copy
lands a window later still (`Readback`). Waiting for it as the window closed, or as the next
step began, was the largest single part of the Monitor's own cost (ranks waiting for each
other and for gloo on shared cores; `benchmarks/overhead.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from meshscope.collector.moe import expert_work, find_moe_layers
from meshscope.collector.readback import Readback

# Token counts are whole numbers: int64 keeps them exact over any window, and every backend
# reduces it (HCCL has no float64 all-reduce).
EXPERT_COUNT_DTYPE = torch.int64
Listener = Callable[[int, torch.Tensor], None]


def _whole(counts: torch.Tensor) -> torch.Tensor:
    """Counts as `EXPERT_COUNT_DTYPE`: the tensor itself when it already is one."""
    if counts.dtype == EXPERT_COUNT_DTYPE:
        return counts
    return counts.detach().round().to(EXPERT_COUNT_DTYPE)


class ExpertCounts:
    """Per-layer expert tokens of this rank's window, and their sum over ranks (module doc)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.control: Any = None  # the Monitor's control plane, once there is one
        self.layers: list[torch.nn.Module] = []
        self.listeners: list[Listener] = []
        self._index: dict[int, int] = {}
        self._acc: list[torch.Tensor | None] = []
        self._like: torch.Tensor | None = None
        self._in_flight: tuple[int, torch.Tensor, Any] | None = None
        self._reads: list[tuple[int, Readback]] = []
        self._work: list[torch.Tensor | None] = []  # this rank's experts' tokens, per layer
        self._work_reads: list[tuple[int, Readback]] = []

    def attach(self, model: torch.nn.Module) -> None:
        """Count the tokens of every MoE layer of `model` (the `collector.moe` protocol)."""
        self.layers = find_moe_layers(model)
        self._index = {id(m): i for i, m in enumerate(self.layers)}
        self._acc = [None] * len(self.layers)
        self._work = [None] * len(self.layers)
        for module in self.layers:
            module.register_forward_hook(self._count)

    def _count(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        # added on the device now (a layer may update its counts in place): no sync. Integer
        # counts (ours) take one op a forward; float ones are rounded first.
        layer = self._index[id(module)]
        counts = _whole(module.expert_token_counts)
        acc = self._acc[layer]
        if acc is None:
            self._acc[layer] = counts.clone() if counts is module.expert_token_counts else counts
        else:
            acc.add_(counts)
        work = expert_work(module)
        if work is not None:
            done = _whole(work.detach().sum())
            self._work[layer] = done if self._work[layer] is None else self._work[layer].add_(done)

    def due(self, step: int) -> bool:
        """Whether `step` closes a window."""
        return bool(self.layers) and (step + 1) % self.every == 0

    def step_ended(self, step: int) -> None:
        """Settle the sum started a step ago; start this window's when `step` closes one."""
        self.settle()
        if self.due(step):
            self._start(step)

    def _start(self, step: int) -> None:
        work, self._work = self._work, [None] * len(self._work)
        if any(w is not None for w in work):  # a per-rank fact: straight to the host, no collective
            zero = next(w for w in work if w is not None)
            self._work_reads.append(
                (step, Readback(torch.stack([zero * 0 if w is None else w for w in work])))
            )
        layers, self._acc = self._acc, [None] * len(self._acc)
        like = next((a for a in layers if a is not None), self._like)
        if like is None:  # no MoE forward yet (on every rank: they step together)
            return
        self._like = like  # from now on this rank always joins the all-reduce
        acc = torch.stack([torch.zeros_like(like) if a is None else a for a in layers])
        work = self.control.all_reduce(acc, async_op=True) if self.control is not None else None
        self._in_flight = (step, acc, work)

    def settle(self) -> None:
        """The sum in flight is done: hand it to the listeners and start its copy to the host."""
        if self._in_flight is None:
            return
        step, acc, work = self._in_flight
        self._in_flight = None
        if work is not None:
            work.wait()  # started a step ago: done (host group), or a stream wait (device group)
        for listener in self.listeners:
            listener(step, acc)
        self._reads.append((step, Readback(acc)))

    def landed(self, block: bool) -> Iterator[tuple[int, list[list[float]]]]:
        """(step, [layer][expert] tokens over ranks) of every window whose copy has landed
        (`block`: settle and wait for all, at flush and close)."""
        if block:
            self.settle()
        while self._reads and (block or self._reads[0][1].ready()):
            step, read = self._reads.pop(0)
            if block:
                read.wait()
            yield step, read.value().tolist()  # host tensor: the landed copy

    def landed_work(self, block: bool) -> Iterator[tuple[int, list[float]]]:
        """(step, [layer] tokens this rank's experts processed over the window) of every
        window whose copy has landed (`block`: wait for all)."""
        while self._work_reads and (block or self._work_reads[0][1].ready()):
            step, read = self._work_reads.pop(0)
            if block:
                read.wait()
            yield step, read.value().tolist()  # host tensor: the landed copy
