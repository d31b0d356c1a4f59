"""Live expert re-placement for an expert-parallel training job: when the experts placed on one
rank get much more than their share of tokens, propose a placement that packs hot experts with
cold ones, as an `expert_placement` change through the control channel.

It runs beside the job (the sidecar's detection rounds, on the judging node): it reads the
expert load rank 0 stores every window, judges the per-rank load under the placement in force
(the last one applied, else experts in order), and, past `threshold` (max / mean per-rank
load) and `cooldown` steps after the last placement, submits the EPLB packing of the recent
load (no replicas: a training expert has one copy per EP group). The trainer applies it at
one step boundary on every rank (`trainer.placement.move_experts`: weights and Adam's moments,
checksummed) and the store records what moved, its cost, and the balance before and after.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from meshscope.collector import controls
from meshscope.collector.figures import balancedness
from meshscope.collector.moe import experts_on
from meshscope.collector.schema import Event
from meshscope.collector.store import insert_events, load_expert_load
from meshscope.feedback.placement import place_experts
from meshscope.feedback.suggestions import Suggestion

log = logging.getLogger("meshscope.rebalance")
RECENT_WINDOWS = 4  # expert-load windows the decision looks at


def rank_loads(load: np.ndarray, placement: list[int], ep: int) -> np.ndarray:
    """Tokens per rank of an EP group: the load of the experts each rank's slots hold."""
    return np.array([sum(load[e] for e in experts_on(placement, ep, r)) for r in range(ep)])


def packed(load: np.ndarray, ep: int) -> list[int]:
    """The slot -> expert list that packs `load` onto `ep` ranks (EPLB's packing, no replicas)."""
    plan = place_experts(load, devices=ep, redundant=0)
    return plan.slot_expert


@dataclass
class Rebalancer:
    """Proposes re-placements for one run (see the module doc)."""

    run_dir: Path
    ep: int
    threshold: float
    cooldown: int
    run_id: str = ""
    proposed: dict[int, int] = field(default_factory=dict)  # layer -> step of the last proposal

    def round(self) -> list[int]:
        """One look at the recent load; the ids of the changes it submitted."""
        load = load_expert_load(self.run_dir)
        if load.empty or self.ep < 2 or self.threshold <= 0:
            return []
        now = int(load["step"].max())
        recent = load[load["step"] >= sorted(load["step"].unique())[-RECENT_WINDOWS:][0]]
        submitted = []
        for layer, rows in recent.groupby("layer"):
            per_expert = rows.groupby("expert")["tokens"].sum().sort_index().to_numpy()
            judged = self._judge(int(layer), per_expert, now)
            if judged is None:
                continue
            change, detail = judged
            cid = controls.submit(self.run_dir, change)
            event = Event(
                kind="placement_proposed", run_id=self.run_id, step=now, detail={"control": cid, **detail}
            )
            insert_events(self.run_dir, [event])
            submitted.append(cid)
        return submitted

    def _judge(self, layer: int, load: np.ndarray, now: int) -> tuple[controls.ControlChange, dict] | None:
        placement, applied_at = controls.placement_at(self.run_dir, layer, len(load))
        since = max(applied_at or -self.cooldown, self.proposed.get(layer, -self.cooldown))
        if now - since < self.cooldown or self._pending(layer):
            return None
        current = rank_loads(load, placement, self.ep)
        if current.mean() <= 0 or current.max() / current.mean() < self.threshold:
            return None
        proposal = packed(load, self.ep)
        better = rank_loads(load, proposal, self.ep)
        if better.max() >= current.max() * 0.97:  # not worth moving weights for
            return None
        self.proposed[layer] = now
        log.warning(
            "layer %d: a rank carries %.2fx the mean load; re-placing experts (balancedness %.2f -> %.2f)",
            layer,
            current.max() / current.mean(),
            balancedness(current),
            balancedness(better),
        )
        detail = {  # the balance it expects; the store's expert_work shows what it got
            "layer": layer,
            "placement_before": placement,
            "placement_after": proposal,
            "rank_tokens_before": current.round().tolist(),
            "rank_tokens_after": better.round().tolist(),
            "max_over_mean_before": round(float(current.max() / current.mean()), 3),
            "max_over_mean_after": round(float(better.max() / better.mean()), 3),
        }
        values = [float(e) for e in proposal]
        return controls.ControlChange(kind="expert_placement", layer=layer, values=values), detail

    def _pending(self, layer: int) -> bool:
        return any(
            c.kind == "expert_placement" and c.layer == layer for _, c in controls.pending(self.run_dir)
        )


def placement_suggestions(run_dir: Path, ep: int, windows: int = RECENT_WINDOWS) -> list[Suggestion]:
    """For an expert-parallel run: per layer, the placement that packs its recent training load
    better over its EP ranks than the one in force, as a suggestion a person can approve (the
    view's Feedback page, `meshscope feedback apply`) to move the experts while it trains."""
    load = load_expert_load(run_dir)
    if load.empty or ep < 2:
        return []
    recent = load[load["step"] >= sorted(load["step"].unique())[-windows:][0]]
    out = []
    for layer, rows in recent.groupby("layer"):
        per_expert = rows.groupby("expert")["tokens"].sum().sort_index().to_numpy()
        placement, _ = controls.placement_at(run_dir, int(layer), len(per_expert))
        current = rank_loads(per_expert, placement, ep)
        proposal = packed(per_expert, ep)
        better = rank_loads(per_expert, proposal, ep)
        if current.mean() <= 0 or better.max() >= current.max() * 0.97:
            continue
        worst, then = current.max() / current.mean(), better.max() / better.mean()
        out.append(
            Suggestion(
                "placement",
                "training",
                int(layer),
                {"ep": ep, "slot_expert": proposal, "placement_before": placement},
                {
                    "rank_balancedness_before": round(balancedness(current), 3),
                    "rank_balancedness_after": round(balancedness(better), 3),
                },
                f"re-place layer {layer}'s experts over its {ep} expert-parallel ranks: the busiest "
                f"rank carries {worst:.2f}x the mean, {then:.2f}x after (weights and optimizer state "
                "move at one step boundary)",
                cause="training_rank_imbalance",
                score=round(balancedness(better) - balancedness(current), 3),
                control={
                    "kind": "expert_placement",
                    "layer": int(layer),
                    "values": [float(e) for e in proposal],
                },
            )
        )
    return out
