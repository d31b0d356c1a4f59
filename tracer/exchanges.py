"""Placing a NaN under expert parallelism, where no re-run can (it needs every EP peer).

Each exchange of an expert-parallel layer tells this watcher what it sent and what arrived,
as this rank's experts see it (`collector.moe.ExchangeSide`): what arrives for them (a
dispatch forward, a combine's gradient) and what leaves from them (a combine forward, a
dispatch's gradient), row by row. A sum of each (one value, or one a row), accumulated in
float32, is computed on the device and read back with the step's loss and gradient norm,
without blocking: non-finite where any value was (NaN and Inf propagate; a half-precision row
cannot overflow float32). A sum reads each value once: on a CPU it costs a fortieth of
`isfinite().all()` and a third of a max of magnitudes.

Between what arrives for a rank's experts and what leaves from them in the same phase, only
those experts compute. So when what arrived was finite and rows that left are not, these
experts made the NaN, on this rank: the holder names the layer's experts and which of them.
A NaN made anywhere else reaches these experts non-finite, or never, and names nothing here.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from meshscope.collector.moe import ExchangeSide


class ExchangeWatch:
    """This rank's look at its experts' exchanges in one step: the sum of what arrived for
    them, and of each row that left from them."""

    def __init__(self) -> None:
        self._marks: list[tuple[ExchangeSide, torch.Tensor]] = []

    @classmethod
    def install(cls, model: torch.nn.Module) -> ExchangeWatch | None:
        """Watch every expert-parallel layer of `model` (None when it has none)."""
        meshes = {id(m.expert_mesh): m.expert_mesh for m in model.modules() if _split(m)}
        if not meshes:
            return None
        watch = cls()
        for mesh in meshes.values():
            mesh.watch = watch.seen
        return watch

    def seen(self, side: ExchangeSide, sent: torch.Tensor, received: torch.Tensor) -> None:
        """An exchange happened (called by the layer): its sums, on the device, no sync."""
        if side.feeds:
            flag = received.detach().sum(dtype=torch.float32).reshape(1)
        else:
            rows = sum(count for _, count in side.runs)
            flat = sent.detach().reshape(rows, -1) if rows else sent.new_zeros(0, 1)
            flag = flat.sum(dim=1, dtype=torch.float32)
        self._marks.append((side, flag))

    def clear(self) -> None:
        """A step starts: what an earlier forward (an evaluation) exchanged is not its own."""
        self._marks = []

    def take(self) -> tuple[list[ExchangeSide], torch.Tensor | None]:
        """The step's exchanges in order and their sums as one float tensor."""
        marks, self._marks = self._marks, []
        if not marks:
            return [], None
        return [side for side, _ in marks], torch.cat([flag for _, flag in marks])


def _split(module: torch.nn.Module) -> bool:
    mesh = getattr(module, "expert_mesh", None)
    return mesh is not None and getattr(mesh, "ep", 1) > 1 and hasattr(mesh, "watch")


def made_here(sides: list[ExchangeSide], sums: list[float]) -> tuple[Any, str, list[int]] | None:
    """The first exchange, in execution order, whose rows left this rank's experts non-finite
    while what arrived for them in that phase was finite: (the experts module, the phase, the
    local experts of the bad rows); None when no experts of this rank made a NaN."""
    fed: dict[tuple[int, str], bool] = {}
    at = 0
    for side in sides:
        count = 1 if side.feeds else sum(rows for _, rows in side.runs)
        values, at = sums[at : at + count], at + count
        key = (id(side.experts), side.phase)
        if side.feeds:
            fed[key] = all(math.isfinite(v) for v in values)
            continue
        if not fed.pop(key, False):  # what they took in was bad already, or never seen
            continue
        bad = sorted({e for e, v in zip(side.row_experts(), values, strict=True) if not math.isfinite(v)})
        if bad:
            return side.experts, side.phase, bad
    return None
