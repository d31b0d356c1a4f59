"""The gradient inspector: per-layer gradient norms and update/weight ratios.

On every `every`-th step, before clipping, the parameters' gradients are reduced to one norm per
layer (a layer: a block of a ModuleList such as `blocks.3`, else a top-level module such as
`embed`), and the weights are copied; after the optimizer the update's norm over the weights'
norm gives the update ratio (healthy training keeps it around 1e-3). All of it is computed on
the device and read back without blocking (`collector.readback`).

The numbers go to the run store (`grad_stats`) and to /metrics; judging them is the detection
engine's (`detectors.rules.GradientRule`: `gradient_exploding` / `gradient_vanishing`
anomalies). DDP all-reduces gradients, so every rank sees the same numbers: rank 0 measures.

Under expert parallelism a rank holds 1/ep of each MoE layer's experts, and their gradients are
reduced over the replicas apart from DDP: the trainer calls `before_clip` once they are, and the
experts rank 0 holds are their own layer, named for the shard (`blocks.1.experts[ep 1/2]`), so
the layer's replicated part (`blocks.1`) is the same number it is without expert parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from meshscope.collector.readback import Readback
from meshscope.tracer.config import InspectorConfig


def layer_names(model: torch.nn.Module) -> dict[str, str]:
    """Parameter name -> its layer: `blocks.3` for a block of a list, else the top module."""
    containers = {
        name
        for name, m in model.named_children()
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))
    }
    out = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        out[name] = ".".join(parts[:2]) if parts[0] in containers and len(parts) > 2 else parts[0]
    return out


def expert_shards(model: torch.nn.Module) -> dict[str, str]:
    """Parameter name -> the layer of the expert shard it belongs to, for every MoE layer split
    over an expert-parallel group (a module with an `expert_mesh` whose `ep` > 1, and `experts`)."""
    names = layer_names(model)
    out = {}
    for prefix, module in model.named_modules():
        mesh = getattr(module, "expert_mesh", None)
        if mesh is None or getattr(mesh, "ep", 1) <= 1 or not hasattr(module, "experts"):
            continue
        for name, _ in module.experts.named_parameters():
            full = f"{prefix}.experts.{name}" if prefix else f"experts.{name}"
            out[full] = f"{names[full]}.experts[ep {mesh.ep_rank + 1}/{mesh.ep}]"
    return out


class GradientInspector:
    """Call `before_clip(step)` after backward and `after_update()` after the optimizer."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: InspectorConfig | None = None,
        *,
        sink: Callable[[list[dict[str, Any]]], None] | None = None,
        export: Callable[[str, float, float], None] | None = None,
    ) -> None:
        self.config = config or InspectorConfig()
        self.sink, self.export = sink, export
        names = layer_names(model) | expert_shards(model)
        self.params = [p for n, p in model.named_parameters() if p.requires_grad]
        layers = [names[n] for n, p in model.named_parameters() if p.requires_grad]
        self.layers = list(dict.fromkeys(layers))
        # the layer index of each parameter, on the device once: copying a pageable host
        # tensor to the device at every sampled step would synchronise the stream
        device = self.params[0].device if self.params else torch.device("cpu")
        self._group = torch.tensor([self.layers.index(x) for x in layers], device=device)
        self._step = -1
        self._grads: torch.Tensor | None = None
        self._before: list[torch.Tensor] | None = None
        self._pending: list[tuple[int, Readback]] = []

    def _per_layer(self, norms: list[torch.Tensor]) -> torch.Tensor:
        """Per-parameter norms -> per-layer norms (square root of the summed squares)."""
        squares = torch.stack([n.float() for n in norms]) ** 2
        return torch.zeros(len(self.layers), device=squares.device).index_add_(0, self._group, squares).sqrt()

    def before_clip(self, step: int) -> None:
        """On a sampled step: gradient norms per layer and a copy of the weights."""
        self._step = step
        if step % self.config.every or not self.params:
            self._grads = None
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        self._grads = self._per_layer(torch._foreach_norm(grads))
        self._before = [p.detach().clone() for p in self.params]

    def after_update(self) -> None:
        """On a sampled step: update and weight norms; judge what has landed."""
        if self._grads is not None and self._before is not None:
            with torch.no_grad():
                diffs = torch._foreach_sub([p.detach() for p in self.params], self._before)
                update = self._per_layer(torch._foreach_norm(diffs))
                weight = self._per_layer(torch._foreach_norm(self._before))
            self._pending.append((self._step, Readback(torch.stack([self._grads, weight, update]))))
            self._grads = self._before = None
        while self._pending and self._pending[0][1].ready():
            step, readback = self._pending.pop(0)
            self._judge(step, readback.value().tolist())  # host tensor: the landed copy

    def close(self) -> None:
        """Judge what is still in flight (waits for the device)."""
        for step, readback in self._pending:
            readback.wait()
            self._judge(step, readback.value().tolist())
        self._pending = []

    def _judge(self, step: int, values: list[list[float]]) -> None:
        grads, weights, updates = values
        rows = []
        for layer, g, w, u in zip(self.layers, grads, weights, updates):
            ratio = u / w if w > 0 else 0.0
            rows.append(
                {"step": step, "module": layer, "grad_norm": g, "weight_norm": w, "update_ratio": ratio}
            )
            if self.export is not None:
                self.export(layer, g, ratio)
        if self.sink is not None:
            self.sink(rows)
