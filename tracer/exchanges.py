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

The other half of each exchange is this rank's own layers' (outside the experts): what they
send to the experts (a dispatch forward, a combine's gradient) and what comes back to them (a
combine forward, a dispatch's gradient), one sum each. This rank's own layers compute from
its data, its weights and what came back to them. So when everything that came back so far
was finite and what they send is not, this rank made the NaN (its weights are checked first):
it names the layer whose exchange first carried it, tensor `input`. A NaN that came back from
a peer's experts names nobody here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from meshscope.collector.moe import ExchangeSide

SENT, RECEIVED = True, False  # which half of an exchange a mark sums
OWN_LAYERS_NOTE = (
    "seen at its expert-parallel exchanges: the first non-finite thing this rank's own layers "
    "sent to the experts (forward: this layer's input; backward: its output's gradient), while "
    "all that came back to them was finite: made on this rank, outside the experts, before this "
    "exchange (or its data)"
)
"""A finding's note when this rank's own layers made the NaN (`Made.local` None)."""


class ExchangeWatch:
    """This rank's look at its exchanges in one step: per exchange, the sum of what was sent
    (one a row where it left this rank's experts) and of what arrived."""

    def __init__(self) -> None:
        self._marks: list[tuple[ExchangeSide, bool, torch.Tensor]] = []

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

    def seen(self, side: ExchangeSide, sent: torch.Tensor | None, received: torch.Tensor | None) -> None:
        """Half an exchange (called by the layer): what it sends, before the exchange (still
        warm), or what arrived, after it; its sums on the device, no sync."""
        if sent is not None and not side.feeds:  # rows that left the experts: one sum a row
            rows = side.rows()
            flat = sent.detach().reshape(rows, -1) if rows else sent.new_zeros(0, 1)
            self._marks.append((side, SENT, flat.sum(dim=1, dtype=torch.float32)))
            return
        half = sent if sent is not None else received
        assert half is not None
        self._marks.append((side, sent is not None, half.detach().sum(dtype=torch.float32).reshape(1)))

    def clear(self) -> None:
        """A step starts: what an earlier forward (an evaluation) exchanged is not its own."""
        self._marks = []

    def take(self) -> tuple[list[tuple[ExchangeSide, bool]], torch.Tensor | None]:
        """The step's marks in order, (side, `SENT` or `RECEIVED`), and their sums as one tensor."""
        marks, self._marks = self._marks, []
        if not marks:
            return [], None
        return [(side, half) for side, half, _ in marks], torch.cat([flag for _, _, flag in marks])


ARRIVED_NOTE = (
    "non-finite at its experts' input, which arrived from its expert-parallel peers while "
    "every module before it on this rank gave finite outputs: made on another rank"
)
"""A finding's note when a NaN reached this rank's experts from a peer (no place, no rank)."""


def fed_by_peers(model: torch.nn.Module) -> set[int]:
    """The modules (ids) whose input arrives through an expert-parallel exchange: each split
    layer's experts. A NaN first seen at their input was made on a peer."""
    return {
        id(m.experts)
        for m in model.modules()
        if _split(m) and isinstance(getattr(m, "experts", None), torch.nn.Module)
    }


def _split(module: torch.nn.Module) -> bool:
    mesh = getattr(module, "expert_mesh", None)
    return mesh is not None and getattr(mesh, "ep", 1) > 1 and hasattr(mesh, "watch")


@dataclass(frozen=True)
class Made:
    """Where a NaN was made, as this rank's exchanges show it: by this rank's `experts` (the
    local experts in `local`), or by this rank's own layers before the exchange (`local` None)."""

    experts: Any
    phase: str
    local: list[int] | None


def made_here(
    marks: list[tuple[ExchangeSide, bool]], sums: list[float], loss_finite: bool = True
) -> Made | None:
    """The first half-exchange, in execution order, that shows this rank made a NaN (module
    doc): rows that left its experts non-finite while what fed them in that phase was finite,
    or what its own layers sent non-finite while everything that came back to them so far was
    finite; None when neither shows. `loss_finite`: this rank's own loss is known finite; else
    its own layers' backward may start from a non-finite loss, and is not shown to be where the
    NaN was made."""
    fed: dict[tuple[int, str], bool] = {}
    came_back_finite, at = True, 0
    for side, half in marks:
        count = side.rows() if half == SENT and not side.feeds else 1
        values, at = sums[at : at + count], at + count
        finite = all(math.isfinite(v) for v in values)
        key = (id(side.experts), side.phase)
        if side.feeds and half == RECEIVED:  # what fed this rank's experts
            fed[key] = finite
        elif not side.feeds and half == RECEIVED:  # what came back to this rank's own layers
            came_back_finite = came_back_finite and finite
        elif side.feeds:  # what this rank's own layers sent
            if not finite and came_back_finite and (loss_finite or side.phase == "forward"):
                return Made(side.experts, side.phase, None)
        elif fed.pop(key, False):  # rows that left the experts, fed finite in this phase
            bad = sorted({e for e, v in zip(side.row_experts(), values, strict=True) if not math.isfinite(v)})
            if bad:
                return Made(side.experts, side.phase, bad)
    return None
