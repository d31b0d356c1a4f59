"""1-bit compression's error feedback kept per parameter, so a restart resumes it exactly.

DDP runs each process's first iteration with every parameter in one bucket and re-buckets after
it in the order backward produced the gradients. Memories kept per bucket (as PowerSGD's are)
therefore never meet a restarted process in the layout they were saved in. Here each
parameter is padded on its own to whole blocks on every rank (`padded_length`), and a bucket's
padded buffer is laid out rank-major: rank r's chunk is chunk r of every parameter in turn. So
which values share a scale, which rank serves which values, and each memory's values never
depend on the bucket a parameter is in: the worker memory of a parameter is its padded length,
the server memory the chunk this rank serves, whatever the layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Layout:
    """Where a bucket's parameters sit in its rank-major padded buffer."""

    names: tuple[str, ...]
    chunks: tuple[int, ...]  # elements of each parameter a rank serves (its padded length / W)
    index: torch.Tensor  # the padded-buffer position of each element of the bucket, in order
    mask: torch.Tensor  # 1.0 where the padded buffer holds a real value
    world: int

    @property
    def chunk(self) -> int:
        """Elements one rank serves (its share of the padded buffer)."""
        return sum(self.chunks)

    @property
    def length(self) -> int:
        """Elements of the padded buffer."""
        return self.world * self.chunk

    def padded_positions(self, i: int) -> torch.Tensor:
        """The padded-buffer positions of parameter i's padded values, in its own order."""
        c, offset = self.chunks[i], sum(self.chunks[:i])
        e = torch.arange(c * self.world, device=self.index.device)
        return (e // c) * self.chunk + offset + e % c

    def served(self, i: int) -> slice:
        """Parameter i's part of the chunk this rank serves."""
        offset = sum(self.chunks[:i])
        return slice(offset, offset + self.chunks[i])


def layout(names: list[str], sizes: list[int], world: int, block: int, device: Any) -> Layout:
    """The rank-major layout of parameters of `sizes` elements, each padded on its own."""
    step = world * block
    chunks = [(n + step - 1) // step * step // world for n in sizes]
    total, parts, offset = sum(chunks), [], 0
    for n, c in zip(sizes, chunks):  # made on the device: a copy from the host would block it
        e = torch.arange(n, device=device)
        parts.append((e // c) * total + offset + e % c)
        offset += c
    index = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)
    mask = torch.zeros(world * total, device=device)
    mask[index] = 1.0
    return Layout(tuple(names), tuple(chunks), index, mask, world)


@dataclass
class ParamMemories:
    """Worker and server error feedback per parameter, assembled into each layout's flat buffers
    as a bucket first uses it (and taken apart again when DDP re-buckets)."""

    by_layout: dict[tuple[str, ...], tuple[Layout, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    loose: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def of(self, lay: Layout) -> tuple[torch.Tensor, torch.Tensor]:
        """(worker [length], server [chunk]) for `lay`, zeros where a parameter has none yet."""
        held = self.by_layout.get(lay.names)
        if held is not None:
            return held[1], held[2]
        self._loosen(set(lay.names))
        worker = torch.zeros(lay.length, device=lay.mask.device)
        server = torch.zeros(lay.chunk, device=lay.mask.device)
        for i, name in enumerate(lay.names):
            kept = self.loose.pop(name, None)
            fits = kept is not None and kept[1].numel() == lay.chunks[i]  # not of another world size
            if fits and kept[0].numel() == lay.chunks[i] * lay.world:
                worker[lay.padded_positions(i)] = kept[0]  # on its device: saved from it
                server[lay.served(i)] = kept[1]
        self.by_layout[lay.names] = (lay, worker, server)
        return worker, server

    def keep(self, lay: Layout, worker: torch.Tensor, server: torch.Tensor) -> None:
        """The memories after a bucket's round."""
        self.by_layout[lay.names] = (lay, worker, server)

    def _loosen(self, names: set[str]) -> None:
        """The layouts holding any of `names` back to per-parameter form (DDP re-bucketed)."""
        for key, (lay, worker, server) in list(self.by_layout.items()):
            if names.isdisjoint(lay.names):
                continue
            self.loose.update(_per_parameter(lay, worker, server))
            del self.by_layout[key]

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        """name -> [worker, server]: plain tensors, whatever the buckets (a checkpoint)."""
        out = {name: [w, s] for name, (w, s) in self.loose.items()}
        for lay, worker, server in self.by_layout.values():
            out.update({name: [w, s] for name, (w, s) in _per_parameter(lay, worker, server).items()})
        return out

    def load_state_dict(self, saved: dict[str, list[torch.Tensor]]) -> None:
        """Memories saved by `state_dict` (a layout that uses them takes them on its first round)."""
        self.by_layout.clear()
        self.loose = {name: (w, s) for name, (w, s) in saved.items()}


def _per_parameter(lay: Layout, worker: torch.Tensor, server: torch.Tensor) -> dict[str, Any]:
    """name -> (its worker memory, its part of the served chunk's), copied out of a layout."""
    return {
        name: (worker[lay.padded_positions(i)].clone(), server[lay.served(i)].clone())
        for i, name in enumerate(lay.names)
    }
