"""From a diagnosis of serving load against training load to ranked suggestions: an
aux-loss-free router bias, the aux-loss coefficient, the capacity factor, and placement."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshscope.collector.controls import BOUNDS
from meshscope.collector.figures import balancedness
from meshscope.collector.store import load_expert_load
from meshscope.feedback.knowledge import KnowledgeBase
from meshscope.feedback.placement import place_experts
from meshscope.feedback.serving import FeedbackError, ServingLoad

HOT, COLD = 1.5, 0.5  # an expert's share against the balanced share 1/E
GAMMA = 1e-3  # DeepSeek-V3's bias update speed (per step, over a long pretraining run)


HORIZON_STEPS = 100  # how soon a suggested bias update should have closed the gap


@dataclass
class LayerDiagnosis:
    """One MoE layer as serving and training see it."""

    layer: int
    serving_balancedness: float
    training_balancedness: float | None
    hot: list[int]
    cold: list[int]
    shares: list[float]
    latency_cost_ms: float | None = None
    note: str = ""
    training_load: list[float] | None = None
    """The run's own recent tokens per expert: what a training-side change acts on."""


def training_load(run_dir: Path, last: int = 5) -> np.ndarray | None:
    """The run's recent expert load [layers, experts] (its last `last` windows), or None."""
    ex = load_expert_load(run_dir)
    if ex.empty:
        return None
    recent = sorted(ex["step"].unique())[-last:]
    ex = ex[ex["step"].isin(recent)]
    table = ex.pivot_table(index="layer", columns="expert", values="tokens", aggfunc="sum")
    return table.sort_index().to_numpy(dtype=float)


def diagnose(serving: ServingLoad, training: np.ndarray | None) -> list[LayerDiagnosis]:
    """Per layer: serving vs training balancedness, hot and cold experts, latency they cost."""
    if training is not None and training.shape != serving.tokens.shape:
        raise FeedbackError(
            f"{serving.source}: {serving.tokens.shape[0]} layers x "
            f"{serving.tokens.shape[1]} experts, but the run has "
            f"{training.shape[0]} x {training.shape[1]}"
        )
    out = []
    for layer, load in enumerate(serving.tokens):
        shares = load / load.sum() if load.sum() > 0 else np.zeros_like(load)
        fair = 1 / len(load)
        hot = [int(e) for e in np.flatnonzero(shares > HOT * fair)]
        cold = [int(e) for e in np.flatnonzero(shares < COLD * fair)]
        cost = None
        if serving.latency_ms is not None and hot:
            lat = serving.latency_ms[layer]
            usual = np.nanmedian(lat)
            cost = float(np.nansum(np.clip(lat[hot] - usual, 0, None)))
        out.append(
            LayerDiagnosis(
                layer,
                balancedness(load),
                None if training is None else balancedness(training[layer]),
                hot,
                cold,
                [round(float(s), 4) for s in shares],
                cost,
                training_load=None if training is None else [float(x) for x in training[layer]],
            )
        )
    return out


@dataclass
class Suggestion:
    """A change in practitioners' terms, with the effect we expect and why."""

    action: str  # router_bias | aux_loss_coef | capacity_factor | placement
    target: str  # "training" or "serving"
    layer: int
    params: dict[str, Any]
    expected: dict[str, float]
    why: str
    cause: str = "serving_imbalance"
    score: float = 0.0
    control: dict[str, Any] | None = None  # the ControlChange that applies it (training only)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (stored in the `suggestion` event)."""
        return asdict(self)


def _shares(load: np.ndarray) -> np.ndarray:
    """Each expert's share of the load, as measured."""
    return np.asarray(load, dtype=float) / max(float(np.sum(load)), 1e-12)


def observed_shares(load: np.ndarray) -> np.ndarray:
    """Each expert's share of the load, read no lower than a correction that lifts an expert
    at most twice as far as it lowers the hottest can use (the factor of two the sign updates
    allow too: the hottest sits at the top-k cap, so its share understates its gap). Under
    top-k routing the cold tail says little (a handful of tokens, or none, moves its log
    share by several logits), and lifting it that far makes the coldest experts the next
    hot spot."""
    share = _shares(load)
    fair = 1.0 / len(share)
    return np.maximum(share, fair * (fair / max(float(share.max()), fair)) ** 2)


def bias_correction(load: np.ndarray, damping: float = 1.0) -> np.ndarray:
    """A one-shot routing bias from measured loads: under softmax routing an expert's share is
    ∝ exp(logit), so shifting its logit by −log(share/mean) evens the shares. Damped (top-k
    and learning interact), bounded, and centred (only differences matter)."""
    share = observed_shares(load)
    bias = -damping * np.log(share / share.mean())
    bias -= bias.mean()
    return np.clip(bias, -BOUNDS.bias_max, BOUNDS.bias_max)


def bias_rate(load: np.ndarray, horizon: int = HORIZON_STEPS) -> float:
    """γ for the sign updates: fast enough that they can move a bias by twice the gap the
    shares show within `horizon` steps (a share at the top-k cap understates the gap, and the
    router keeps learning), never below DeepSeek-V3's 1e-3 and never above half the bound.
    DeepSeek's 1e-3 suits a run of many thousand steps; in 100 it moves a bias by 0.1. The
    gap is read from the raw shares, cold tail and all: the speed only bounds how far the
    updates may go, and they stop where the loads even out."""
    share = np.clip(_shares(load), 1e-6, None)
    gap = float(np.abs(np.log(share / share.mean())).max())
    return float(min(BOUNDS.bias_rate_max / 2, max(GAMMA, round(2 * gap / horizon, 4))))


def predicted_balancedness(load: np.ndarray, bias: np.ndarray) -> float:
    """Balancedness after a bias shift, under the same softmax model (and the same reading of
    an expert that routed nothing)."""
    return balancedness(observed_shares(load) * np.exp(bias))


def _router_bias(
    d: LayerDiagnosis, load: np.ndarray, model: dict[str, Any], devices: int
) -> Suggestion | None:
    """The aux-loss-free bias update (DeepSeek-V3) that evens this layer's routing. Serving's
    skew says the layer needs it; the bias acts on the training router, so it is sized from
    what that router routes now where the run is known (sized from serving's load, when the
    two disagree about which experts are hot, it boosts the expert training already favours).
    None when the training router is even already: serving's skew is its traffic's."""
    if d.training_load is None:
        routed, sized, before = load, "serving's shares", d.serving_balancedness
    else:
        routed = np.asarray(d.training_load, dtype=float)
        sized, before = "the training router's own recent shares", balancedness(routed)
    bias = bias_correction(routed)
    after = predicted_balancedness(routed, bias)
    if d.training_load is not None and after <= before + 0.01:
        return None
    gamma = bias_rate(routed)
    slow = (
        ""
        if gamma == GAMMA
        else f" (DeepSeek-V3's {GAMMA:g} would take {np.abs(bias).max() / GAMMA:.0f} steps to move the "
        f"bias as far as the shares say; this closes it within {HORIZON_STEPS})"
    )
    return Suggestion(
        "router_bias",
        "training",
        d.layer,
        {"gamma": gamma, "bias": bias.round(4).tolist()},
        {"balancedness_before": round(before, 3), "balancedness_after": round(after, 3)},
        f"layer {d.layer}: experts {d.hot} take {sum(d.shares[e] for e in d.hot):.0%} of "
        f"serving tokens (balanced {len(load) and 1 / len(load):.0%} each); the aux-loss-free "
        f"bias update (DeepSeek-V3) shifts routing only, the gates stay, so the loss is not "
        f"pulled by a balancing term; a one-shot correction from {sized}, then "
        f"sign updates with γ={gamma:g}" + slow,
        control={"kind": "router_bias", "layer": d.layer, "values": [gamma, *bias.round(4).tolist()]},
    )


def _aux_loss(d: LayerDiagnosis, load: np.ndarray, model: dict[str, Any], devices: int) -> Suggestion:
    """A stronger load-balancing loss (slower than the bias; it costs some LM loss)."""
    coef = float(model.get("aux_loss_coef", 0.01))
    new_coef = min(BOUNDS.aux_loss_coef_max, max(2 * coef, 1e-3))
    return Suggestion(
        "aux_loss_coef",
        "training",
        -1,
        {"from": coef, "to": new_coef},
        {
            "balancedness_before": round(d.serving_balancedness, 3),
            "balancedness_after": round(min(1.0, d.serving_balancedness + 0.1), 3),
        },
        "a stronger load-balancing loss evens routing through the gradient: slower than the "
        "bias, and it trades some language-model loss for balance",
        control={"kind": "aux_loss_coef", "layer": -1, "values": [new_coef]},
    )


def _capacity(d: LayerDiagnosis, load: np.ndarray, model: dict[str, Any], devices: int) -> Suggestion | None:
    """A capacity factor the hottest expert fits in (None when it fits already)."""
    factor = float(model.get("capacity_factor", 1.25))
    need = max(d.shares) * len(load)  # the hottest expert's share over the fair share
    if need <= factor:
        return None
    new = min(BOUNDS.capacity_factor_max, round(need + 0.05, 2))
    return Suggestion(
        "capacity_factor",
        "training",
        d.layer,
        {"from": factor, "to": new},
        {
            "dropped_share_before": round(_dropped(load, factor), 3),
            "dropped_share_after": round(_dropped(load, new), 3),
        },
        f"at this load the hottest expert needs {need:.2f}x its fair share; tokens over "
        f"capacity skip it (memory and compute grow with the factor)",
        control={"kind": "capacity_factor", "layer": d.layer, "values": [new]},
    )


def _placement(d: LayerDiagnosis, load: np.ndarray, model: dict[str, Any], devices: int) -> Suggestion | None:
    """EPLB placement for serving (None when the default layout is as balanced)."""
    plan = place_experts(load, devices=devices, redundant=max(1, devices // 2))
    if plan.after <= plan.before + 0.01:  # the default layout is as good: nothing to move
        return None
    return Suggestion(
        "placement",
        "serving",
        d.layer,
        {
            "devices": devices,
            "replicas": plan.replicas,
            "device_of_slot": plan.device_of_slot,
            "slot_expert": plan.slot_expert,
        },
        {
            "device_balancedness_before": round(plan.before, 3),
            "device_balancedness_after": round(plan.after, 3),
        },
        f"replicate the heaviest experts ({plan.redundant} extra slots) and pack them onto "
        f"{devices} devices by load (as DeepSeek's EPLB does)",
    )


# What a skewed layer can be offered, in this order (each may have nothing to offer).
REMEDIES = [_router_bias, _aux_loss, _capacity, _placement]


def suggest(
    diagnoses: list[LayerDiagnosis],
    serving: ServingLoad,
    *,
    model: dict[str, Any] | None = None,
    devices: int = 8,
    kb: KnowledgeBase | None = None,
    skew_below: float = 0.8,
) -> list[Suggestion]:
    """Suggestions for the layers whose serving load is skewed, ranked by expected gain and by
    how such suggestions worked before."""
    model = model or {}
    out = [
        s
        for d in diagnoses
        if d.serving_balancedness < skew_below
        for remedy in REMEDIES
        if (s := remedy(d, serving.tokens[d.layer], model, devices)) is not None
    ]
    for s in out:
        if kb is not None and "balancedness_after" in s.expected and kb.outcomes(s.cause, s.action):
            # what such changes delivered before calibrates what this one promises
            b0, b1 = s.expected["balancedness_before"], s.expected["balancedness_after"]
            s.expected["balancedness_after"] = round(b0 + (b1 - b0) * kb.realised(s.cause, s.action), 3)
            s.expected["calibrated_by_outcomes"] = True
        s.score = _gain(s) * (kb.weight(s.cause, s.action) if kb is not None else 1.0)
    return sorted(out, key=lambda s: -s.score)


def _gain(s: Suggestion) -> float:
    e = s.expected
    if "rank_balancedness_after" in e:
        return e["rank_balancedness_after"] - e["rank_balancedness_before"]
    if "balancedness_after" in e:
        return e["balancedness_after"] - e["balancedness_before"]
    if "device_balancedness_after" in e:
        return e["device_balancedness_after"] - e["device_balancedness_before"]
    return e.get("dropped_share_before", 0) - e.get("dropped_share_after", 0)


def _dropped(load: np.ndarray, factor: float) -> float:
    total = load.sum()
    cap = factor * total / len(load)
    return float(np.clip(load - cap, 0, None).sum() / total) if total > 0 else 0.0
