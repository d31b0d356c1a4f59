"""Expert load as the Monitor counts it: tokens each MoE layer's experts received, noted after
every forward, added up on the device and summed over ranks once per window of `every` steps.

The sum is the one collective the Monitor adds, issued straight on the control plane's group
with a flight-log record packed once (`collector.flightfixed`). On the host, when nothing
needs the sum at a given step (no listener), the training thread only hands the window's
references over as the window closes: the Monitor's service thread stacks, sums and
all-reduces them on the plane's service group, which only that work uses, so every rank
issues its sums in window order whichever thread runs them (a stack, a sum and gloo's launch
were most of what the Monitor cost the training thread). Otherwise it holds no step: the
all-reduce starts as the step that closes a window ends and is settled as the next step ends,
a whole step later, when it has long finished (on the host gloo's threads carry it meanwhile;
on an accelerator the settle is a stream wait, no host block). Listeners (a trainer's bias
update) get the summed load then, on every rank at the same step, one step after the window
closed; the host copy lands a window later still (`Readback`). Waiting for it as the window
closed, or as the next step began, was the largest single part of the Monitor's own cost
(ranks waiting for each other and for gloo on shared cores; `benchmarks/overhead.py`).

Off the thread, windows are summed a group at a time, one all-reduce for several: each wakes
gloo's threads on every rank, and at 16 windows a second that was most of what the Monitor
cost the process beyond its own threads. The ranks must cut the same groups without a clock:
each sum carries, after the windows, every rank's proposal for the next group's size (the
windows `GROUP_S` seconds hold at the pace its training thread handed them over lately),
so every rank reads the same mean off the same sum, and one group is in flight at a time.
The first group is one window. A group is never cut short mid-run, so a `flush()` on one
rank alone stays safe (its windows of a group still filling wait); the Monitor's `close()`,
on every rank after the same steps, sums the last one, however short.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from meshscope.collector.comm import after_forward
from meshscope.collector.flightfixed import start_sum
from meshscope.collector.moe import expert_work, find_moe_layers
from meshscope.collector.readback import Readback

log = logging.getLogger("meshscope.monitor")

# Token counts are whole numbers: int64 keeps them exact over any window, and every backend
# reduces it (HCCL has no float64 all-reduce).
EXPERT_COUNT_DTYPE = torch.int64
EXPERT_LOAD_SITE = "meshscope expert load (sum over ranks)"  # its flight-log records' call site
# Windows one sum over ranks may carry on the service thread (module doc): each group size is
# a shape the flight log keeps a record for
MAX_GROUP = 64
# Seconds of windows a group carries: one all-reduce in that time wakes gloo's threads once
# (each cost more than the sum itself on a busy host), and the expert series lag the steps by
# about that much more (an imbalance alert waits minutes; a heatmap scrapes every few seconds)
GROUP_S = 2.0
Listener = Callable[[int, torch.Tensor], None]


def _stamp(counts: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A counts tensor and its version: what tells a layer that ran from one that did not (an
    inference-mode tensor keeps no version: its identity alone tells)."""
    return counts, -1 if counts.is_inference() else counts._version


def _copy(counts: torch.Tensor) -> torch.Tensor:
    """The counts as they are now, as a normal tensor (a forward under inference mode too)."""
    with torch.inference_mode(False):
        return _whole(counts.detach()).clone()


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
        # this window's counts as noted after each forward: (layer, counts, version when noted;
        # None for a copy)
        self._noted: list[tuple[int, torch.Tensor, int | None]] = []
        self._seen: list[tuple[torch.Tensor, int]] = []  # each layer's counts as last noted
        self._warned = False
        self._like: torch.Tensor | None = None
        self._in_flight: tuple[int, torch.Tensor, Any] | None = None
        self._reads: list[tuple[int, Readback]] = []
        self._work: list[torch.Tensor | None] = []  # this rank's experts' tokens, per layer
        self._idle_work: list[Any] = []
        self._work_reads: list[tuple[int, Readback]] = []
        # Host counts may be summed off the training thread (module doc): set by the Monitor,
        # decided at the first window (listeners are registered after the Monitor is built)
        self.host_counts = False
        self._off_thread: bool | None = None
        self._handed: deque[tuple[int, list[tuple[int, torch.Tensor, int | None]]]] = deque()
        # the group of windows summed off the thread, one at a time: ((step, shape) of each
        # window, the sum, its Work); and how many windows the next group takes, which every
        # rank reads off the sum before it (module doc)
        self._group_sum: tuple[list[tuple[int, torch.Size]], torch.Tensor, Any] | None = None
        self._group = 1
        self._left = 0  # windows left waiting when `serve` last returned
        # (when, windows handed over by then) at `serve`'s calls over the last GROUP_S seconds
        # and one before: the pace of this rank's windows (`_propose`)
        self._arrived = 0
        self._pace: deque[tuple[float, int]] = deque([(time.monotonic(), 0)])
        self.closing = False  # the Monitor's close: the last group may be short (module doc)

    def attach(self, model: torch.nn.Module, hook: bool = True) -> None:
        """Count the tokens of every MoE layer of `model` (the `collector.moe` protocol) after
        each of its forwards: one watch on the model's forward, not a hook per layer (each
        Python hook costs a step ~25 us, and a large MoE has dozens of layers). `hook=False`:
        the caller's own watch on the model calls `forward_done`."""
        self.layers = find_moe_layers(model)
        self._seen = [_stamp(m.expert_token_counts) for m in self.layers]
        self._work = [None] * len(self.layers)
        # C's: each layer's empty `expert_work`, or False where it has none (`collector/csrc/`)
        self._idle_work = [None] * len(self.layers)
        if hook and self.layers:
            after_forward(model, self._on_forward)

    def _on_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.forward_done()

    def forward_done(self, start: int = 0) -> None:
        """Note the counts of every layer that ran in the forward just finished: a reference
        to a layer's new tensor, summed with the rest once a window (`_window_sum`), or a copy
        when the layer updates one tensor in place. No device op per forward for a layer that
        hands out new counts (each op costs the step a dispatch), and no sync either way. A
        layer run twice in one forward counts its last run (the protocol's "last forward").
        `start`: the first layer to look at (C noted those before, `collector/csrc/`)."""
        noted, seen_by_layer = self._noted, self._seen
        for layer in range(start, len(self.layers)):
            module = self.layers[layer]
            counts = module.expert_token_counts
            seen, version = seen_by_layer[layer]
            if counts is not seen and not counts.is_inference():  # new counts: a reference
                version = counts._version
                seen_by_layer[layer] = (counts, version)
                noted.append((layer, counts, version))
            elif counts is not seen or (version >= 0 and counts._version != version):
                # an inference tensor (it keeps no version), or changed in place: copy now
                seen_by_layer[layer] = _stamp(counts)
                noted.append((layer, _copy(counts), None))
            else:
                continue  # the layer did not run
            self._note_work(layer, module)

    def _note_work(self, layer: int, module: torch.nn.Module) -> None:
        """Under expert parallelism, the tokens this rank's experts of `layer` processed."""
        if (work := expert_work(module)) is not None:
            self._add_work(layer, work)

    def _add_work(self, layer: int, work: torch.Tensor) -> None:
        with torch.inference_mode(False):  # the window's sums stay normal tensors
            done = _whole(work.detach().sum())
            self._work[layer] = done if self._work[layer] is None else self._work[layer].add_(done)

    def _window_sum(self, noted: list[tuple[int, torch.Tensor, int | None]]) -> torch.Tensor | None:
        """A window's tokens, [layer, expert], from the counts noted in it (None: no MoE
        forward). One stack and one sum when every forward ran every layer."""
        if not noted:
            return None
        self._warn_changed(noted)
        parts = [_whole(counts) for _, counts, _ in noted]
        layers = len(self.layers)
        if len(noted) % layers == 0 and all(n[0] == i % layers for i, n in enumerate(noted)):
            return torch.stack(parts).view(len(noted) // layers, layers, -1).sum(0)
        acc = parts[0].new_zeros((layers, parts[0].numel()))
        for layer in {n[0] for n in noted}:
            acc[layer] = torch.stack([p for p, n in zip(parts, noted) if n[0] == layer]).sum(0)
        return acc

    def _warn_changed(self, noted: list[tuple[int, torch.Tensor, int | None]]) -> None:
        """Say once that a layer changed counts in place after handing them out as new."""
        changed = [layer for layer, counts, seen in noted if seen is not None and counts._version != seen]
        if changed and not self._warned:
            self._warned = True
            log.warning(
                "meshscope: MoE layer %d changed expert_token_counts in place after handing them "
                "out as new; its window's load is read as it is now",
                changed[0],
            )

    def step_ended(self, step: int) -> None:
        """Settle the sum started a step ago; start this window's when `step` closes one."""
        if self._in_flight is not None:
            self.settle()
        if self.layers and (step + 1) % self.every == 0:  # this step closes a window
            if self._off_thread is None:
                self._off_thread = self._can_hand_over()
            if self._off_thread:
                self._take_work(step)
                self._handed.append((step, self._take_noted()))
            else:
                self._start(step)

    def _can_hand_over(self) -> bool:
        """Whether this run's windows are summed by the service thread (module doc): host
        counts, no listener, and a service group to sum them on."""
        group = getattr(self.control, "service_group", None)
        return self.host_counts and not self.listeners and group is not None

    def _take_noted(self) -> list[tuple[int, torch.Tensor, int | None]]:
        """The closed window's noted counts. The list itself stays: C appends to it
        (`collector/csrc/`, which keeps it from the Monitor's `_route_steps`)."""
        noted = self._noted[:]
        self._noted.clear()
        return noted

    def _start(self, step: int) -> None:
        self._take_work(step)
        noted = self._take_noted()
        acc = self._window_acc(noted)
        if acc is None:
            return
        work = self.control.start_sum(acc, EXPERT_LOAD_SITE) if self.control is not None else None
        self._in_flight = (step, acc, work)

    def _take_work(self, step: int) -> None:
        work, self._work = self._work, [None] * len(self._work)
        if any(w is not None for w in work):  # a per-rank fact: straight to the host, no collective
            zero = next(w for w in work if w is not None)
            self._work_reads.append(
                (step, Readback(torch.stack([zero * 0 if w is None else w for w in work]), owned=True))
            )

    def _window_acc(self, noted: list[tuple[int, torch.Tensor, int | None]]) -> torch.Tensor | None:
        """The window's sum to all-reduce; None before this rank's first MoE forward (on every
        rank alike: they step together). A window without one joins with zeros."""
        acc = self._window_sum(noted)
        if acc is None and self._like is None:
            return None
        if acc is None:
            acc = torch.zeros_like(self._like)
        self._like = acc
        return acc

    def serve(self, block: bool) -> None:
        """The service thread's part (or flush's, under the Monitor's drain lock): land the
        group of windows in flight once its sum is done (`block`: wait for it), then start the
        next group's, in window order, on the service group (module doc)."""
        arrivals = len(self._handed) - self._left  # since the last call: only training appends
        proposal = self._propose(arrivals)
        try:
            while True:
                if self._group_sum is not None:
                    if not (block or self._group_sum[2].is_completed()):
                        return
                    self._land(*self._group_sum)
                    self._group_sum = None
                size = self._group if len(self._handed) >= self._group else 0
                if self.closing and self._handed:  # every rank closes after the same windows
                    size = min(self._group, len(self._handed))
                if not size:
                    return
                self._start_group(size, proposal)
        finally:
            self._left = len(self._handed)

    def _propose(self, arrivals: int) -> int:
        """This rank's proposal for the next group's size, with `arrivals` windows handed over
        since the last call: the windows `GROUP_S` seconds hold at the pace of the last
        `GROUP_S` seconds (not its backlog: that is at least a group already), 1 to
        `MAX_GROUP`."""
        self._arrived += arrivals
        now, pace = time.monotonic(), self._pace
        pace.append((now, self._arrived))
        while len(pace) > 2 and now - pace[1][0] >= GROUP_S:
            pace.popleft()
        since, before = pace[0]
        rate = (self._arrived - before) / (now - since) if now > since else 0.0
        return min(max(round(rate * GROUP_S), 1), MAX_GROUP)

    def _start_group(self, size: int, proposal: int) -> None:
        """Sum `size` handed windows over ranks in one all-reduce, with this rank's proposal
        for the next group's size at its end (`_propose`)."""
        summed = self._group_tables([self._handed.popleft() for _ in range(size)], proposal)
        if summed is None:  # no MoE forward yet: on every rank alike (they step together)
            return
        steps, stacked = summed
        work = start_sum(self.control.service_group, stacked, EXPERT_LOAD_SITE, steps[-1])
        shape = self._like.shape  # type: ignore[union-attr]  (set by `_group_tables`)
        self._group_sum = ([(step, shape) for step in steps], stacked, work)

    def _group_tables(
        self, windows: list[tuple[int, list[tuple[int, torch.Tensor, int | None]]]], proposal: int
    ) -> tuple[list[int], torch.Tensor] | None:
        """The windows' tables ([layer, expert] each, one after another) and `proposal` after
        them, flat, with the steps that closed them: one stack and one indexed add for the
        whole group (a stack and a sum a window cost the service thread ~35 us each on a busy
        host). As `_window_acc`: a window without a MoE forward joins with zeros once one came
        before; None when none has yet."""
        layers = len(self.layers)
        steps: list[int] = []
        parts: list[torch.Tensor] = []
        rows: list[int] = []
        for step, noted in windows:
            if not noted and not parts and self._like is None:
                continue
            self._warn_changed(noted)
            rows.extend(len(steps) * layers + layer for layer, _, _ in noted)
            parts.extend(_whole(counts) for _, counts, _ in noted)
            steps.append(step)
        if not steps:
            return None
        experts = parts[0].numel() if parts else self._like.shape[-1]  # type: ignore[union-attr]
        flat = torch.zeros(len(steps) * layers * experts + 1, dtype=EXPERT_COUNT_DTYPE)
        tables = flat[:-1].view(len(steps), layers, experts)
        if parts:  # every forward's counts into its window's row of its layer
            counts = torch.stack(parts).view(len(parts), -1)
            tables.view(-1, experts).index_add_(0, torch.tensor(rows), counts)
        flat[-1] = proposal
        self._like = tables[-1]
        return steps, flat

    def _land(self, windows: list[tuple[int, torch.Size]], stacked: torch.Tensor, work: Any) -> None:
        """A group's sum is done: each window's table to the host reads, and the next group's
        size, the ranks' mean proposal, read off the same sum on every rank."""
        work.wait()  # done already (or flush's wait); raises what failed it
        start = 0
        for step, shape in windows:  # no listener: no one writes the sum after this
            end = start + shape.numel()
            self._reads.append((step, Readback(stacked[start:end].view(shape), owned=True)))
            start = end
        ranks = self.control.service_group.size()
        self._group = max(1, min(MAX_GROUP, int(stacked[-1]) // ranks))

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
        if self._off_thread:
            self.serve(block)
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
