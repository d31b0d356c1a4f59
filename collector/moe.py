"""The MoE protocol: how the Monitor sees any MoE layer, ours or a user's.

A module is an MoE layer for meshscope if it has an attribute `expert_token_counts`: a 1-D
tensor, one entry per expert, holding the tokens routed to each expert in its last forward
(before capacity dropping, so the entries sum to tokens x top_k). The tensor may live on the
device; the Monitor reads it without a sync and sums it over ranks every few steps. It reads
every layer once after the model's forward, so a layer sets the attribute to a new tensor
each forward or updates it in place: counts that are the same tensor at the same version as
last time are a layer that did not run. A new tensor is read when its window closes, so a
layer does not change it after handing it out (the Monitor warns once if one does).

Under expert parallelism a layer may also expose `expert_work`: a 1-D tensor, one entry per
expert this rank holds, of the tokens those experts processed in its last forward (from every
sender, after capacity). It is a per-rank fact: the Monitor adds it up per layer and window on
the device and stores it per rank, with no collective.

Experts held as one stacked tensor per weight (index 0 is the expert) have no submodule each:
`stacked_experts` says how many a module holds, so an expert is named as `PATH.INDEX`.

An expert-parallel layer may show a watcher each exchange as its own experts see it
(`ExchangeSide`): what arrives for them, or what leaves from them, row by row. No re-run can
localise a NaN there (it needs every EP peer); what a holder's experts took in and gave out
can (`tracer.exchanges`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PROTOCOL_ATTRIBUTE = "expert_token_counts"
WORK_ATTRIBUTE = "expert_work"


@dataclass(frozen=True, slots=True)
class ExchangeSide:
    """One expert-parallel exchange as this rank's experts see it, told to a watcher with what
    was sent and what arrived: where a NaN under expert parallelism can still be placed."""

    experts: torch.nn.Module  # the layer's experts: the module a finding names
    phase: str  # "forward" or "backward"
    feeds: bool  # what arrives goes into this rank's experts; else what leaves came out of them
    runs: tuple[tuple[int, int], ...] = ()  # what leaves, in row order: (local expert, rows)

    def row_experts(self) -> list[int]:
        """The local expert of each row of what leaves."""
        return [expert for expert, rows in self.runs for _ in range(rows)]

    def rows(self) -> int:
        """Rows of what leaves the experts."""
        return sum(rows for _, rows in self.runs)


def experts_on(placement: Sequence[int], ep: int, rank: int) -> list[int]:
    """The experts `rank` holds under expert parallelism: slot s lives on EP rank s // (E/ep)
    (the rank's EP rank is rank mod ep) and holds expert placement[s]."""
    per = len(placement) // ep
    mine = rank % ep
    return list(placement[mine * per : (mine + 1) * per])


def expert_work(module: torch.nn.Module) -> torch.Tensor | None:
    """The tokens the experts this rank holds processed in the layer's last forward (None: the
    layer holds every expert, or says nothing)."""
    work = getattr(module, WORK_ATTRIBUTE, None)
    return work if isinstance(work, torch.Tensor) and work.numel() else None


def is_moe_layer(module: torch.nn.Module) -> bool:
    """Whether `module` follows the MoE protocol (exposes its per-expert token counts)."""
    return isinstance(getattr(module, PROTOCOL_ATTRIBUTE, None), torch.Tensor)


def find_moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """MoE layers in definition order; their index is the `layer` label."""
    return [m for m in model.modules() if is_moe_layer(m)]


def stacked_experts(module: torch.nn.Module) -> int | None:
    """How many experts a module holds as one stacked tensor per weight (index 0 of every own
    parameter is the expert), or None: such experts have no submodule of their own to name."""
    try:
        count = len(module)  # type: ignore[arg-type]
    except TypeError:
        return None
    params = list(module.parameters(recurse=False))
    if count < 2 or not params or any(p.dim() == 0 or p.shape[0] != count for p in params):
        return None
    return count
