"""Approved changes reach the running model here, at step boundaries, on every rank at once.

Every `control_every` steps rank 0 reads the run store's pending changes (one read-only
SQLite query) and the control plane broadcasts the oldest one as a host tensor: a header
[id, kind, layer, n] then, when there is a change, its n values. Every rank checks the bounds
again and applies it before the next step, so all ranks change at the same step. Rank 0 settles
the change in the store and writes a `suggestion_applied` event with the step, the old and the
new values. A change outside the bounds is refused, on every rank alike, and logged.

Only rank 0 talks to the store (at start too: the changes applied before a restart go to the
other ranks over the control plane), and a job store that does not answer never stops a step:
changes wait (one warning per outage), a settle that could not be written is retried at the
next poll, and a change applied here is never applied twice while its settle waits.

The aux-loss-free bias update (DeepSeek-V3: b_e += γ·sign(mean load − load_e)) runs on every
rank from the expert load the Monitor already sums over ranks, on the device: no extra
collective, no readback, and identical biases everywhere.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from meshscope.collector import controls
from meshscope.collector.control import ControlPlane
from meshscope.collector.controls import BOUNDS, KIND_CODES, ControlChange
from meshscope.collector.monitor import Monitor
from meshscope.collector.storedb import StoreUnavailable

log = logging.getLogger("meshscope.controls")

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
        self._unsettled: dict[int, dict[str, Any]] = {}  # applied here, settle not yet stored
        self._store_down = False  # warned for this outage
        self._scheduled: dict[int, list[ControlChange]] = {}  # step -> changes applied from it before

    # --- changes --------------------------------------------------------------------------
    def replay_applied(self, resumed_at: int | None = None, saved: dict[str, Any] | None = None) -> None:
        """After a restart, the changes approved before are in force again, on every rank
        alike: rank 0 reads them (one connection per job) and the control plane hands them on.
        With the checkpoint's values (`saved`, from `state_dict`) the run is the interrupted
        one: those values hold at the resume step, and each change applied after the
        checkpoint lands again at the step it first did. A run that starts again from step 0
        (`resumed_at` None: no checkpoint yet) meets every change at its own step the same
        way. Only a checkpoint without the values (of another world size) sets every applied
        change now."""
        fresh = resumed_at is None  # from the initial values, like the first attempt
        if fresh:
            resumed_at, saved = 0, {}
        if saved is not None:
            self.load_state_dict(saved)
        rows = self._applied_before() if self.rank == 0 else []
        count = self.plane.broadcast_int(len(rows)) if self.plane is not None else len(rows)
        for i in range(count):
            header = torch.zeros(_HEADER, dtype=torch.float64)
            held_from = torch.zeros(1, dtype=torch.float64)  # the step it held from
            if self.rank == 0:
                cid, change, held_from[0] = rows[i]
                header[:] = _header(cid, change) if change is not None else torch.tensor([cid, 0, 0, 0])
            if self.plane is not None:
                self.plane.broadcast(held_from, src=0)
            own = rows[i][1].values if self.rank == 0 and rows[i][1] is not None else []
            values = self._agree(header, own) or []
            since = int(held_from[0])  # host tensor: the control plane's
            try:
                change = ControlChange.parse(
                    {"kind": _KINDS.get(int(header[1]), "?"), "layer": int(header[2]), "values": values}
                )
            except (controls.ControlError, ValueError):
                change = None  # refused then: it still took its poll
            if saved is None or (fresh and since <= 0):  # no values to start from, or no step
                if change is not None:
                    self._set_quietly(change)
            elif since > resumed_at:  # else in the checkpoint's values already
                # the poll it landed at is taken again: a pending change waits for the next one
                self._scheduled.setdefault(since, []).extend([change] if change is not None else [])

    def _set_quietly(self, change: ControlChange) -> None:
        """Set a change recorded as applied before (nothing to settle)."""
        try:
            self._set(change, self._targets(change.layer))
        except (controls.ControlError, ValueError):
            pass

    def state_dict(self) -> dict[str, Any]:
        """The values the approved changes (and the bias updates since) hold now, for a
        checkpoint: plain lists and numbers (it is loaded with `weights_only=True`)."""
        return {
            "aux_loss_coef": getattr(self.model, "aux_loss_coef", None),
            "layers": [
                {
                    "capacity_factor": layer.capacity_factor,
                    "bias_rate": layer.router.bias_rate,
                    # sync point: a checkpoint only
                    "routing_bias": None
                    if layer.router.routing_bias is None
                    else layer.router.routing_bias.tolist(),
                }
                for layer in self.layers
            ],
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Put back the values `state_dict` kept (a model of another shape keeps its own)."""
        if saved.get("aux_loss_coef") is not None:
            self.model.aux_loss_coef = saved["aux_loss_coef"]
        if len(saved.get("layers", [])) != len(self.layers):
            return
        for layer, kept in zip(self.layers, saved["layers"]):
            layer.capacity_factor, layer.router.bias_rate = kept["capacity_factor"], kept["bias_rate"]
            bias = kept["routing_bias"]
            device = layer.router.gate.weight.device
            layer.router.routing_bias = (
                None if bias is None else torch.tensor(bias, dtype=torch.float32, device=device)
            )

    def _applied_before(self) -> list[tuple[int, ControlChange | None, int]]:
        """(id, change, step) of every change settled before, in the order they were: a
        refused one (None) took its poll as an applied one did."""
        try:
            rows = controls.load_controls(self.run_dir)
        except StoreUnavailable as err:
            log.warning("job store down (%s): the changes applied before the restart are not re-applied", err)
            return []
        out = []
        for _, row in rows[rows["status"].isin(["applied", "refused"])].iterrows():
            fields = {"kind": row["kind"], "layer": int(row["layer"]), "values": row["payload"]}
            since = int(row["step"]) if row["step"] == row["step"] else 0  # NaN: never recorded
            try:
                change = ControlChange.parse(fields) if row["status"] == "applied" else None
            except (controls.ControlError, ValueError):
                change = None
            out.append((int(row["id"]), change, since))
        return out

    def _pending(self) -> list[tuple[int, ControlChange]]:
        """Rank 0's pending changes, less those applied here whose settle waits; none while the
        job store does not answer (the step goes on)."""
        try:
            self._settle_waiting()
            found = controls.pending(self.run_dir)
        except StoreUnavailable as err:
            if not self._store_down:
                log.warning("job store down (%s): approved changes wait; training goes on", err)
            self._store_down = True
            return []
        self._store_down = False
        return [(cid, change) for cid, change in found if cid not in self._unsettled]

    def at_boundary(self, step: int) -> None:
        """Called by every rank after step `step`; collective on the poll steps."""
        replayed = self._scheduled.pop(step + 1, None)  # a resumed run meets its own changes
        for change in replayed or []:
            self._set_quietly(change)
        if (step + 1) % self.every or replayed is not None:  # a replayed change's poll is taken
            return
        found = self._pending()[:1] if self.rank == 0 else []
        header = torch.zeros(_HEADER, dtype=torch.float64)
        if found:
            header[:] = _header(*found[0])
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
        from meshscope.trainer.placement import move_experts

        moe = self.layers[layer]
        if getattr(moe, "expert_mesh", None) is None or self.optimizer is None:
            raise ValueError("expert_placement: this run holds every expert on every rank (parallel.ep=1)")
        old = moe.slot_expert.tolist()  # a change is rare: one readback
        agree = self.plane.agree_all if self.plane is not None else bool
        cost = move_experts(moe, self.optimizer, slots, agree)
        return {layer: {"placement": old}}, {layer: {"placement": slots, **cost}}

    def _settle(self, cid: int, status: str, step: int, old: Any, new: Any, note: str) -> None:
        if self.rank != 0:
            return
        self._unsettled[cid] = {"status": status, "step": step, "old": old, "new": new, "note": note}
        try:
            self._settle_waiting()
        except StoreUnavailable:
            pass  # retried at the next poll; the event below reaches the store through the node's
        self.mon.event(
            "suggestion_applied",
            severity="info" if status == "applied" else "warning",
            step=step,
            detail={"control": cid, "status": status, "old": old, "new": new, "note": note},
        )

    def _settle_waiting(self) -> None:
        """Store the fate of the changes applied here whose settle could not be written yet."""
        for cid, fate in list(self._unsettled.items()):
            controls.settle(self.run_dir, cid, **fate)
            del self._unsettled[cid]

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


def _header(cid: int, change: ControlChange) -> torch.Tensor:
    """The control plane's header of a change: [id, kind code, layer, number of values]."""
    fields = [cid, KIND_CODES.get(change.kind, 0), change.layer, len(change.values)]
    return torch.tensor(fields, dtype=torch.float64)
