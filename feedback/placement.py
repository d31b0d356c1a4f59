"""EPLB-style expert placement for serving: replicate the hottest experts and pack experts
onto devices so the busiest device carries as little as possible."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshscope.collector.figures import balancedness


@dataclass
class Placement:
    """Physical slots for one layer: which expert each holds and on which device."""

    replicas: list[int]  # per logical expert
    slot_expert: list[int]  # per physical slot
    device_of_slot: list[int]
    before: float  # device balancedness without replicas (experts dealt round-robin)
    after: float
    redundant: int = 0


def place_experts(load: np.ndarray, *, devices: int, redundant: int) -> Placement:
    """EPLB-style: give each extra slot to the expert with the highest load per replica, pack
    replicas (heaviest first) onto the least-loaded device with a free slot, then swap slots
    between the busiest and the idlest device while that lowers the busiest one. `before` is
    the default expert-parallel layout (contiguous blocks of experts per device)."""
    load = np.asarray(load, dtype=float)
    experts = len(load)
    slots = experts + redundant
    if slots % devices:  # every device gets the same number of slots
        redundant += devices - slots % devices
        slots = experts + redundant
    replicas = np.ones(experts, dtype=int)
    for _ in range(redundant):
        replicas[int(np.argmax(load / replicas))] += 1
    weights = sorted(
        ((load[e] / replicas[e], e) for e in range(experts) for _ in range(replicas[e])), key=lambda x: -x[0]
    )
    capacity = slots // devices
    bins: list[list[tuple[float, int]]] = [[] for _ in range(devices)]
    for item in weights:
        free = [d for d in range(devices) if len(bins[d]) < capacity]
        bins[min(free, key=lambda d: sum(w for w, _ in bins[d]))].append(item)
    _refine(bins)
    slot_expert = [e for b in bins for _, e in b]
    device_of_slot = [d for d, b in enumerate(bins) for _ in b]
    device_load = [sum(w for w, _ in b) for b in bins]
    per_device = -(-experts // devices)
    default = np.zeros(devices)
    for e in range(experts):
        default[min(e // per_device, devices - 1)] += load[e]
    return Placement(
        replicas.tolist(),
        slot_expert,
        device_of_slot,
        balancedness(default),
        balancedness(np.array(device_load)),
        redundant,
    )


def _refine(bins: list[list[tuple[float, int]]], rounds: int = 200) -> None:
    """Swap one slot of the busiest device with one of another device while that lowers the
    peak: the swap that leaves the pair's larger load smallest. (The idlest device alone is
    not enough: when its slots are all light, the swap that helps is with a middle one.)"""
    for _ in range(rounds):
        totals = [sum(w for w, _ in b) for b in bins]
        hi = int(np.argmax(totals))
        best = None
        for other in (d for d in range(len(bins)) if d != hi):
            for i, (wi, _) in enumerate(bins[hi]):
                for j, (wj, _) in enumerate(bins[other]):
                    peak = max(totals[hi] - (wi - wj), totals[other] + (wi - wj))
                    if peak < totals[hi] - 1e-12 and (best is None or peak < best[0]):
                        best = (peak, other, i, j)
        if best is None:
            return
        _, lo, i, j = best
        bins[hi][i], bins[lo][j] = bins[lo][j], bins[hi][i]
