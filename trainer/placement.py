"""Live re-placement of a sharded MoE layer's experts: all or nothing, and only what moves.

A placement lists, slot by slot, the expert each slot holds (slot s lives on EP rank
s // (E/ep)). A change of placement sends each expert that changes rank, with its Adam
moments, point to point from its old holder to its new one (one `batch_isend_irecv` over the
EP row, which NCCL and HCCL run as one group call); an expert that stays on its rank is
reordered in place. Every transfer carries a checksum computed on the device, so nothing is
read back to the host but one flag. The flags are agreed job-wide before anything changes:
every EP row applies the same placement, and the replicas of an expert must keep holding the
same one, so a single bad arrival anywhere leaves every rank where it was.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

_CHUNK = 1 << 22  # elements per checksum pass: bounds its temporary memory
_MODULUS = 65521  # position weights stay small, so an int64 sum cannot overflow


class PlacementFailed(ValueError):
    """A re-placement every rank refused alike: every expert stayed where it was (a ValueError,
    so the control that asked for it is refused, not the worker ended)."""


def checksum(parts: list[torch.Tensor]) -> torch.Tensor:
    """A position-weighted sum of the bytes of `parts`, as int64 on their device: a flipped
    bit or a swapped pair of values changes it (Fletcher's idea, without a host readback)."""
    total = torch.zeros(2, dtype=torch.int64, device=parts[0].device)
    for part in parts:
        raw = part.detach().contiguous().view(-1).view(torch.uint8)
        words = raw.view(torch.int16) if raw.numel() % 2 == 0 else raw  # |word| < 2^15
        for start in range(0, words.numel(), _CHUNK):
            chunk = words[start : start + _CHUNK].to(torch.int64)
            weight = torch.arange(start, start + chunk.numel(), device=chunk.device) % _MODULUS + 1
            # < 2^15 · 2^16 · 2^22 = 2^53 a pass: exact up to 2^10 passes (4·10^9 words)
            total += torch.stack([chunk.sum(), (chunk * weight).sum()])
    return total


def _holders(placement: list[int], per: int) -> dict[int, tuple[int, int]]:
    """expert -> (EP rank, local index) under `placement`."""
    return {expert: divmod(slot, per) for slot, expert in enumerate(placement)}


def move_experts(
    layer: Any, optimizer: torch.optim.Optimizer, new: list[int], agree: Callable[[bool], bool]
) -> dict[str, Any]:
    """Re-place one layer's experts at a step boundary (collective: every rank of the job calls
    it with the same `new` slot -> expert list). `agree(ok)` is True only when every rank of
    the job is ok. Returns what moved and what it cost; PlacementFailed when any arrival failed
    its checksum (nothing moved anywhere)."""
    mesh = layer.expert_mesh
    old = layer.slot_expert.tolist()  # sync point: a re-placement is rare
    total, per = len(old), len(old) // mesh.ep
    if sorted(new) != list(range(total)):
        raise ValueError(f"values: a placement lists each of the {total} experts once, got {new}")
    started = time.perf_counter()
    params = list(layer.experts.parameters())
    tensors = [p.data for p in params] + [
        optimizer.state[p][k]
        for p in params
        for k in ("exp_avg", "exp_avg_sq")
        if k in optimizer.state.get(p, {})
    ]
    was, will = _holders(old, per), _holders(new, per)
    moved = [e for e in range(total) if was[e][0] != will[e][0]]
    arrivals = _transfer(mesh, tensors, moved, was, will)
    if mesh.mid_move is not None:
        mesh.mid_move()
    checks = [(checksum(got) == sent).all() for got, sent in arrivals.values()]
    ok = not checks or bool(torch.stack(checks).all())  # sync point: a re-placement is rare
    if not agree(ok):
        raise PlacementFailed("a moved expert failed its checksum on some rank; nothing was moved")
    for index, t in enumerate(tensors):
        fresh = torch.empty_like(t)
        for expert, (rank, local) in will.items():
            if rank != mesh.ep_rank:
                continue
            fresh[local] = arrivals[expert][0][index] if expert in arrivals else t[was[expert][1]]
        t.copy_(fresh)
    layer.slot_expert.copy_(torch.tensor(new, device=layer.slot_expert.device))
    sent = sum(t[0].numel() * t.element_size() for t in tensors) * len(moved)
    return {"moved": moved, "bytes": sent, "seconds": round(time.perf_counter() - started, 4)}


def _transfer(
    mesh: Any,
    tensors: list[torch.Tensor],
    moved: list[int],
    was: dict[int, tuple[int, int]],
    will: dict[int, tuple[int, int]],
) -> dict[int, tuple[list[torch.Tensor], torch.Tensor]]:
    """Send each moved expert this rank holds to its new rank and receive the ones it will
    hold, in expert order on both sides. Returns expert -> (its tensors, the sender's checksum)."""
    ops, arrivals = [], {}
    peer = lambda r: dist.get_global_rank(mesh.ep_group, r)  # noqa: E731
    for expert in moved:
        (src, local), (dst, _) = was[expert], will[expert]
        if src == mesh.ep_rank:
            payload = [t[local].contiguous() for t in tensors]
            payload.append(checksum(payload))
            ops += [dist.P2POp(dist.isend, x, peer(dst), mesh.ep_group) for x in payload]
        if dst == mesh.ep_rank:
            got = [torch.empty_like(t[0]) for t in tensors]
            sent = torch.empty(2, dtype=torch.int64, device=tensors[0].device)
            ops += [dist.P2POp(dist.irecv, x, peer(src), mesh.ep_group) for x in (*got, sent)]
            arrivals[expert] = (got, sent)
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return arrivals
