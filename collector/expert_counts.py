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


def _stamp(counts: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A counts tensor and its version: what tells a layer that ran from one that did not (an
    inference-mode tensor keeps no version: its identity alone tells)."""
    return counts, -1 if counts.is_inference() else counts._version


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
        self._acc: torch.Tensor | None = None  # this window's tokens, [layer, expert]
        self._seen: list[tuple[torch.Tensor, int]] = []  # each layer's counts as last added
        self._like: torch.Tensor | None = None
        self._in_flight: tuple[int, torch.Tensor, Any] | None = None
        self._reads: list[tuple[int, Readback]] = []
        self._work: list[torch.Tensor | None] = []  # this rank's experts' tokens, per layer
        self._work_reads: list[tuple[int, Readback]] = []

    def attach(self, model: torch.nn.Module, hook: bool = True) -> None:
        """Count the tokens of every MoE layer of `model` (the `collector.moe` protocol) after
        each of its forwards: one hook on the model, not one per layer (each Python hook costs
        a step ~25 us, and a large MoE has dozens of layers). `hook=False`: the caller's own
        hook on the model calls `forward_done`."""
        self.layers = find_moe_layers(model)
        self._seen = [_stamp(m.expert_token_counts) for m in self.layers]
        self._work = [None] * len(self.layers)
        if hook and self.layers:
            model.register_forward_hook(self._on_forward)

    def _on_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.forward_done()

    def forward_done(self) -> None:
        """Add up the counts of every layer that ran in the forward just finished (its counts
        are a new tensor, or the same one changed in place), on the device: no sync. A layer
        run twice in one forward counts its last run (the protocol's "last forward")."""
        counts = [self._fresh(i, m) for i, m in enumerate(self.layers)]
        if torch.is_inference_mode_enabled():  # the window's sums stay normal tensors
            with torch.inference_mode(False):
                self._add(counts)
        else:
            self._add(counts)

    def _add(self, counts: list[torch.Tensor | None]) -> None:
        ran = [c for c in counts if c is not None]
        if not ran:
            return
        if len(ran) == len(counts):  # every layer ran: one stack, one add
            added = torch.stack(ran)
            self._acc = added if self._acc is None else self._acc.add_(added)
        else:
            if self._acc is None:
                self._acc = ran[0].new_zeros((len(counts), ran[0].numel()))
            for layer, c in enumerate(counts):
                if c is not None:
                    self._acc[layer].add_(c)
        for layer, module in enumerate(self.layers):  # expert parallelism: what each layer's experts did
            if counts[layer] is not None and (work := expert_work(module)) is not None:
                done = _whole(work.detach().sum())
                self._work[layer] = done if self._work[layer] is None else self._work[layer].add_(done)

    def _fresh(self, layer: int, module: torch.nn.Module) -> torch.Tensor | None:
        """The layer's counts as `EXPERT_COUNT_DTYPE` when it ran since they were last added
        (None: it did not run, e.g. a layer skipped this forward)."""
        stamp = _stamp(module.expert_token_counts)
        if stamp[0] is self._seen[layer][0] and stamp[1] == self._seen[layer][1]:
            return None
        self._seen[layer] = stamp
        return _whole(stamp[0])

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
        acc, self._acc = self._acc, None
        if acc is None and self._like is None:  # no MoE forward yet (on every rank: they step together)
            return
        if acc is None:  # none this window, but this rank has joined the all-reduce before
            acc = torch.zeros_like(self._like)
        self._like = acc
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
