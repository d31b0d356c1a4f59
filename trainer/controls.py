"""Approved changes reach the running model here, at step boundaries, on every rank at once.

Every `control_every` steps rank 0 reads the run store's pending changes (one read-only
SQLite query) and the control plane broadcasts the oldest one as a host tensor: a header
[id, kind, layer, n] then, when there is a change, its n values. Every rank checks the bounds
again and applies it before the next step, so all ranks change at the same step. Rank 0 settles
the change in the store and writes a `suggestion_applied` event with the step, the old and the
new values. A change outside the bounds is refused, on every rank alike, and logged.

The aux-loss-free bias update (DeepSeek-V3: b_e += γ·sign(mean load − load_e)) runs on every
rank from the expert load the Monitor already sums over ranks, on the device: no extra
collective, no readback, and identical biases everywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from meshscope.collector import controls
from meshscope.collector.control import ControlPlane
from meshscope.collector.controls import BOUNDS, KIND_CODES, ControlChange
from meshscope.collector.monitor import Monitor

_KINDS = {code: kind for kind, code in KIND_CODES.items()}
_HEADER = 4  # id, kind code, layer, number of values


class ControlApplier:
    """Reads, agrees on and applies approved changes; updates routing biases from loads."""

    def __init__(
        self,
        model: torch.nn.Module,
        mon: Monitor,
        run_dir: Path,
        *,
        rank: int,
        every: int,
        plane: ControlPlane | None,
        expert_every: int,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self.model, self.mon, self.run_dir = model, mon, Path(run_dir)
        self.optimizer = optimizer  # an expert placement moves Adam's moments with the weights
        self.rank, self.every, self.plane = rank, every, plane
        self.expert_every = expert_every
        self.layers = list(getattr(model, "moe_layers", lambda: [])())
        mon.expert_load_listeners.append(self._update_biases)

    # --- changes --------------------------------------------------------------------------
    def replay_applied(self) -> None:
        """Re-apply, on this rank alone, the changes applied before a restart (the store is
        the record; every rank reads the same rows, so all end up alike)."""
        rows = controls.load_controls(self.run_dir)
        for _, row in rows[rows["status"] == "applied"].iterrows():
            try:
                change = ControlChange.parse(
                    {"kind": row["kind"], "layer": int(row["layer"]), "values": row["payload"]}
                )
                self._set(change, self._targets(change.layer))
            except (controls.ControlError, ValueError):
                continue

    def at_boundary(self, step: int) -> None:
        """Called by every rank after step `step`; collective on the poll steps."""
        if (step + 1) % self.every:
            return
        found = controls.pending(self.run_dir)[:1] if self.rank == 0 else []
        header = torch.zeros(_HEADER, dtype=torch.float64)
        if found:
            cid, change = found[0]
            header[:] = torch.tensor(
                [cid, KIND_CODES.get(change.kind, 0), change.layer, len(change.values)], dtype=torch.float64
            )
        values = self._agree(header, found[0][1].values if found else [])
        if values is None:
            return
        cid, code, layer = int(header[0]), int(header[1]), int(header[2])  # host tensor
        self._apply(cid, _KINDS.get(code, "?"), layer, values, step + 1)

    def _agree(self, header: torch.Tensor, values: list[float]) -> list[float] | None:
        if self.plane is not None:
            self.plane.broadcast(header, src=0)
        if int(header[0]) == 0:  # host tensor: the control plane's
            return None
        # host tensor: the control plane's
        payload = torch.tensor(values if self.rank == 0 else [0.0] * int(header[3]), dtype=torch.float64)
        if self.plane is not None:
            self.plane.broadcast(payload, src=0)
        return payload.tolist()  # host tensor

    def _apply(self, cid: int, kind: str, layer: int, values: list[float], step: int) -> None:
        try:
            change = ControlChange.parse({"kind": kind, "layer": layer, "values": values})
            targets = self._targets(change.layer)
            old, new = self._set(change, targets)
        except (controls.ControlError, ValueError) as err:
            self._settle(cid, "refused", step, None, None, str(err))
            return
        self._settle(cid, "applied", step, old, new, "")

    def _targets(self, layer: int) -> list[int]:
        if not self.layers:
            raise ValueError("this model has no MoE layer to change")
        if layer == -1:
            return list(range(len(self.layers)))
        if layer >= len(self.layers):
            raise ValueError(f"layer {layer}: the model has {len(self.layers)} MoE layers")
        return [layer]

    def _set(self, change: ControlChange, targets: list[int]) -> tuple[Any, Any]:
        v = change.values
        if change.kind == "aux_loss_coef":
            old = getattr(self.model, "aux_loss_coef", None)
            self.model.aux_loss_coef = v[0]
            return old, v[0]
        if change.kind == "expert_placement":
            return self._place(targets[0], [int(x) for x in v])
        if change.kind == "capacity_factor":
            old = {i: self.layers[i].capacity_factor for i in targets}
            for i in targets:
                self.layers[i].capacity_factor = v[0]
            return old, {i: v[0] for i in targets}
        rate, bias = v[0], v[1:]
        experts = self.layers[targets[0]].router.experts
        if len(bias) != experts:
            raise ValueError(f"values: {len(bias)} biases for {experts} experts")
        old, new = {}, {}
        for i in targets:
            router = self.layers[i].router
            old[i] = {
                "rate": router.bias_rate,
                "bias": None if router.routing_bias is None else router.routing_bias.tolist(),
            }  # a change is rare: one readback
            device = router.gate.weight.device
            router.routing_bias = torch.tensor(bias, dtype=torch.float32, device=device)
            router.bias_rate = rate
            new[i] = {"rate": rate, "bias": list(bias)}
        return old, new

    def _place(self, layer: int, slots: list[int]) -> tuple[Any, Any]:
        """Move one layer's experts to `slots` (collective over its EP group, every rank alike)."""
        from meshscope.trainer.experts import move_experts

        moe = self.layers[layer]
        if getattr(moe, "expert_mesh", None) is None or self.optimizer is None:
            raise ValueError("expert_placement: this run holds every expert on every rank (parallel.ep=1)")
        old = moe.slot_expert.tolist()  # a change is rare: one readback
        cost = move_experts(moe, self.optimizer, slots)
        return {layer: {"placement": old}}, {layer: {"placement": slots, **cost}}

    def _settle(self, cid: int, status: str, step: int, old: Any, new: Any, note: str) -> None:
        if self.rank != 0:
            return
        controls.settle(self.run_dir, cid, status=status, step=step, old=old, new=new, note=note)
        self.mon.event(
            "suggestion_applied",
            severity="info" if status == "applied" else "warning",
            step=step,
            detail={"control": cid, "status": status, "old": old, "new": new, "note": note},
        )

    # --- aux-loss-free bias ---------------------------------------------------------------
    def _update_biases(self, step: int, load: torch.Tensor) -> None:
        """b += γ·(steps in the window)·sign(mean load − load), per layer with γ > 0."""
        for i, moe in enumerate(self.layers):
            router = moe.router
            if router.bias_rate <= 0 or router.routing_bias is None or i >= load.shape[0]:
                continue
            counts = load[i].to(router.routing_bias.device, torch.float32)
            push = torch.sign(counts.mean() - counts) * (router.bias_rate * self.expert_every)
            router.routing_bias = (router.routing_bias + push).clamp(-BOUNDS.bias_max, BOUNDS.bias_max)
