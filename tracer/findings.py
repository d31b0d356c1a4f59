"""What the tracer finds: a `Finding` (the first non-finite module of a step), and the small
pieces it reads tensors and RNG state with."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from meshscope.collector.moe import experts_on, stacked_experts
from meshscope.collector.readback import Readback

Report = Callable[[str, int, dict[str, Any]], None]  # (kind, step, detail)


def _floats(values: Any) -> list[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        return [values.detach()] if values.is_floating_point() else []
    if isinstance(values, (list, tuple)):
        return [v.detach() for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return []


def _finite(values: Any) -> bool:
    # sync point: host reads, only after a finding (to tell input, parameter, output apart)
    return all(bool(torch.isfinite(t).all()) for t in _floats(values))


def nonfinite_experts(module: torch.nn.Module, tensors: Any) -> list[int]:
    """Which experts of a stacked-experts module hold the non-finite values among `tensors`
    (each indexed by expert first, as its weights and its slot table are); [] for others."""
    count = stacked_experts(module)
    if count is None:
        return []
    bad = torch.zeros(count, dtype=torch.bool)
    for t in _floats(tensors):
        if t.dim() and t.shape[0] == count:
            # sync point: host reads, only after a finding
            bad |= ~torch.isfinite(t.reshape(count, -1)).all(dim=1).cpu()
    return [int(i) for i in torch.nonzero(bad).flatten()]


def first_nonfinite_weights(modules: list[torch.nn.Module]) -> int | None:
    """The index of the first module (in `modules`' order) whose own weights hold a NaN or
    Inf: a look at what this rank holds, for a step no re-run can localise."""
    owned = [(i, p.detach()) for i, m in enumerate(modules) for p in m.parameters(recurse=False)]
    owned = [(i, p) for i, p in owned if p.is_floating_point() and p.numel()]
    if not owned:
        return None
    # sync point: host reads, only after a non-finite step
    norms = torch.stack(
        [n.float().reshape(()) for n in torch._foreach_norm([p for _, p in owned], float("inf"))]
    )
    bad = [i for (i, _), v in zip(owned, norms.tolist(), strict=True) if not math.isfinite(v)]
    return bad[0] if bad else None


def held_experts(model: torch.nn.Module, name: str, local: list[int]) -> list[int]:
    """`local` slices of the stacked experts `name` as the layer's expert numbers: under expert
    parallelism a rank holds a slice of the layer's experts (its placement says which)."""
    owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    mesh, placement = getattr(owner, "expert_mesh", None), getattr(owner, "slot_expert", None)
    if mesh is None or placement is None:
        return local
    held = experts_on(placement.tolist(), mesh.ep, mesh.ep_rank)  # sync point: after a finding only
    return [held[i] for i in local]


class _Ready:
    """Host values already in hand, in the shape of a Readback."""

    def __init__(self, values: list[float]) -> None:
        self._values = torch.tensor(values, dtype=torch.float64)

    def ready(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def value(self) -> torch.Tensor:
        return self._values


def _device_rng(model: torch.nn.Module) -> Any:
    """The RNG state of the model's accelerator, if it has one."""
    param = next(model.parameters(), None)
    if param is None or param.device.type == "cpu":
        return None
    module = getattr(torch, param.device.type, None)
    return module.get_rng_state(param.device) if module is not None else None


def _set_rng(model: torch.nn.Module, state: tuple[torch.Tensor, Any]) -> None:
    cpu, device = state
    torch.set_rng_state(cpu)
    if device is not None:
        param = next(model.parameters())
        getattr(torch, param.device.type).set_rng_state(device, param.device)


@dataclass
class _Span:
    where: str
    index: int
    first: tuple[int, int]  # outputs (forward) or output gradients (backward)
    second: tuple[int, int] = (0, 0)  # input gradients (backward)


@dataclass
class _Step:
    step: int
    spans: list[_Span]
    readback: Readback | None
    forward: list[tuple[int, tuple, Any]]
    backward: list[tuple[int, Any, Any]]


@dataclass
class Finding:
    """The first non-finite module of a step."""

    module: str
    where: str
    tensor: str
    step: int
    rank: int
    module_class: str
    note: str = ""
    snapshot: str | None = None
    experts: list[int] = field(default_factory=list)
    """Inside stacked experts (one module, E slices): the experts whose slice went bad."""

    def detail(self) -> dict[str, Any]:
        """The `nan` event's detail."""
        return {
            "module": self.module,
            "experts": self.experts,
            "where": self.where,
            "tensor": self.tensor,
            "class": self.module_class,
            "note": self.note,
            "snapshot": self.snapshot,
        }


def output_stats(forward: list[tuple[int, tuple, Any]], names: list[str], step: int, rank: int) -> list[dict]:
    """Per-module output statistics of a hooked step (absmax, norm, mean, std, non-finite
    count), reduced on the device and read at once: the `tensor_stats` rows."""
    rows = []
    outs = [(index, _floats(output)) for index, _a, output in forward]
    outs = [(i, o[0]) for i, o in outs if o]
    if not outs:
        return []
    ts = [t for _, t in outs]
    absmax = torch._foreach_norm(ts, float("inf"))
    norm = torch._foreach_norm(ts, 2)
    stacked = torch.stack(
        [
            torch.stack(
                [
                    a.float(),
                    n.float(),
                    t.float().mean(),
                    t.float().std() if t.numel() > 1 else t.new_zeros(()),
                    (~torch.isfinite(t)).sum().float(),
                ]
            )
            for a, n, t in zip(absmax, norm, ts)
        ]
    )
    values = stacked.cpu().tolist()  # sync point: sampled stats steps only
    for (index, _t), (a, n, mean, std, nonfinite) in zip(outs, values):
        rows.append(
            {
                "step": step,
                "rank": rank,
                "module": names[index] or "model",
                "where": "forward",
                "absmax": a,
                "norm": n,
                "mean": mean,
                "std": std,
                "nonfinite": int(nonfinite),
            }
        )
    return rows
