"""The training–inference feedback loop: serving-side expert load in, suggestions out, outcomes
measured and remembered.

- **In** (`read_serving_load`): SGLang's expert-distribution dump (a `.pt` holding
  `logical_count[steps, layers, experts]`), vLLM's EPLB load window (`.pt` holding
  `expert_load_window[window, layers, physical experts]` and, when experts are replicated,
  `physical_to_logical_map[layers, physical]`), or a CSV `layer, expert, tokens[, latency_ms]`.
  `.pt` files are read with `torch.load(weights_only=True)`: tensors and plain containers only,
  never code.
- **Diagnose** (`diagnose`): per layer, serving balancedness against training's, the experts
  responsible, and the latency they cost when the file has it.
- **Suggest** (`suggest`): the aux-loss-free expert-bias update of DeepSeek-V3 (routing only),
  the aux-loss coefficient, the capacity factor, and for serving an EPLB-style placement with
  replicas (`place_experts`); each with its expected effect, ranked by what the knowledge base
  learnt from earlier outcomes.
- **Learn** (`measure_outcome`, `KnowledgeBase`): after K steps, balancedness, step time and loss
  against the prediction, stored as cause → action → outcome.
"""

from __future__ import annotations

import io
import json
import math
import sqlite3
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from meshscope.collector.controls import BOUNDS, ControlChange
from meshscope.collector.figures import balancedness
from meshscope.collector.rundir import run_info
from meshscope.collector.store import load_expert_load, load_steps

GAMMA = 1e-3  # DeepSeek-V3's bias update speed (per step, over a long pretraining run)
HORIZON_STEPS = 100  # how soon a suggested bias update should have closed the gap
HOT, COLD = 1.5, 0.5  # an expert's share against the balanced share 1/E
MAX_UPLOAD_BYTES = 256 * 2**20


class FeedbackError(ValueError):
    """An input the loop cannot use; the message says what is wrong and what is expected."""


@dataclass
class ServingLoad:
    """Tokens (and optionally latency) per layer and logical expert, as serving measured them."""

    tokens: np.ndarray  # [layers, experts]
    latency_ms: np.ndarray | None  # [layers, experts] or None
    source: str


# --- in ---------------------------------------------------------------------------------------


def read_serving_load(data: bytes, name: str) -> ServingLoad:
    """Parse an upload by its content (a zip/pickle .pt or CSV text); FeedbackError when it is
    not one of the formats the loop reads."""
    if len(data) > MAX_UPLOAD_BYTES:
        raise FeedbackError(
            f"{name}: {len(data) / 2**20:.0f} MiB is over the {MAX_UPLOAD_BYTES // 2**20} MiB limit"
        )
    if not data:
        raise FeedbackError(f"{name}: the file is empty")
    if data[:2] == b"PK" or data[:1] == b"\x80" or name.endswith((".pt", ".pth")):
        return _read_pt(data, name)
    return _read_csv(data, name)


def _read_pt(data: bytes, name: str) -> ServingLoad:
    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # protocol notes on foreign pickles
            obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many kinds for foreign or hostile files
        raise FeedbackError(
            f"{name}: not a tensor file that can be read safely: only tensors "
            f"and plain containers are accepted, never code "
            f"({type(err).__name__})"
        ) from None
    if isinstance(obj, dict) and "logical_count" in obj:
        counts, source = _as_array(obj["logical_count"], name, "logical_count"), "sglang"
    elif isinstance(obj, dict) and "expert_load_window" in obj:
        counts, source = _as_array(obj["expert_load_window"], name, "expert_load_window"), "vllm"
        mapping = obj.get("physical_to_logical_map")
        if mapping is not None:
            counts = _logical(counts, _as_array(mapping, name, "physical_to_logical_map"), name)
    elif isinstance(obj, torch.Tensor):
        counts, source = _as_array(obj, name, "tensor"), "tensor"
    else:
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise FeedbackError(
            f"{name}: expected SGLang's `logical_count` or vLLM's `expert_load_window`, found {keys}"
        )
    if counts.ndim == 2:
        counts = counts[None]
    if counts.ndim != 3:
        raise FeedbackError(f"{name}: expected [steps, layers, experts], got shape {list(counts.shape)}")
    return _checked(counts.sum(axis=0), None, f"{source}:{name}")


def _as_array(value: Any, name: str, key: str) -> np.ndarray:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64).numpy()
    try:
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise FeedbackError(f"{name}: `{key}` is not numeric") from None


def _logical(window: np.ndarray, mapping: np.ndarray, name: str) -> np.ndarray:
    """Physical-expert loads summed onto logical experts (vLLM replicates hot experts)."""
    if window.ndim != 3 or mapping.ndim != 2 or mapping.shape != window.shape[1:]:
        raise FeedbackError(
            f"{name}: physical_to_logical_map {list(mapping.shape)} does not "
            f"match expert_load_window {list(window.shape)}"
        )
    experts = int(mapping.max()) + 1
    out = np.zeros((window.shape[0], window.shape[1], experts))
    for layer in range(window.shape[1]):
        for phys, logical in enumerate(mapping[layer].astype(int)):
            if logical >= 0:
                out[:, layer, logical] += window[:, layer, phys]
    return out


def _read_csv(data: bytes, name: str) -> ServingLoad:
    try:
        df = pd.read_csv(io.BytesIO(data))
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise FeedbackError(f"{name}: not a CSV ({str(err).splitlines()[0][:200]})") from None
    df.columns = [str(c).strip().lower() for c in df.columns]
    missing = {"layer", "expert", "tokens"} - set(df.columns)
    if missing:
        raise FeedbackError(
            f"{name}: CSV needs columns layer, expert, tokens[, latency_ms]; "
            f"missing {', '.join(sorted(missing))} (found {list(df.columns)})"
        )
    for col in ("layer", "expert", "tokens", "latency_ms"):
        if col in df.columns:
            bad = pd.to_numeric(df[col], errors="coerce").isna()
            if bad.any():
                row = int(bad.idxmax()) + 2  # 1-based, after the header
                raise FeedbackError(f"{name}: row {row}: {col} {df[col][bad].iloc[0]!r} is not a number")
            df[col] = pd.to_numeric(df[col])
    if (
        (df[["layer", "expert"]] < 0).any().any()
        or (df["layer"] % 1 != 0).any()
        or (df["expert"] % 1 != 0).any()
    ):
        raise FeedbackError(f"{name}: layer and expert must be whole numbers >= 0")
    layers, experts = int(df["layer"].max()) + 1, int(df["expert"].max()) + 1
    if layers * experts > 1_000_000:
        raise FeedbackError(f"{name}: {layers} layers x {experts} experts is too large")
    tokens = np.zeros((layers, experts))
    np.add.at(tokens, (df["layer"].astype(int), df["expert"].astype(int)), df["tokens"])
    latency = None
    if "latency_ms" in df.columns:
        latency = np.full((layers, experts), np.nan)
        latency[df["layer"].astype(int), df["expert"].astype(int)] = df["latency_ms"]
    return _checked(tokens, latency, f"csv:{name}")


def _checked(tokens: np.ndarray, latency: np.ndarray | None, source: str) -> ServingLoad:
    if not np.isfinite(tokens).all() or (tokens < 0).any():
        raise FeedbackError(f"{source}: token counts must be finite and >= 0")
    if tokens.sum() <= 0:
        raise FeedbackError(f"{source}: no tokens at all")
    return ServingLoad(tokens, latency, source)


# --- diagnose ---------------------------------------------------------------------------------


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
            )
        )
    return out


# --- suggest ----------------------------------------------------------------------------------


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


def bias_correction(load: np.ndarray, damping: float = 1.0) -> np.ndarray:
    """A one-shot routing bias from measured loads: under softmax routing an expert's share is
    ∝ exp(logit), so shifting its logit by −log(share/mean) evens the shares. Damped (top-k
    and learning interact), bounded, and centred (only differences matter)."""
    load = np.asarray(load, dtype=float)
    share = np.clip(load / max(load.sum(), 1e-12), 1e-6, None)
    bias = -damping * np.log(share / share.mean())
    bias -= bias.mean()
    return np.clip(bias, -BOUNDS.bias_max, BOUNDS.bias_max)


def bias_rate(load: np.ndarray, horizon: int = HORIZON_STEPS) -> float:
    """γ for the sign updates: fast enough that they can move a bias by twice the gap the
    shares show within `horizon` steps (a share at the top-k cap understates the gap, and the
    router keeps learning), never below DeepSeek-V3's 1e-3 and never above half the bound.
    DeepSeek's 1e-3 suits a run of many thousand steps; in 100 it moves a bias by 0.1."""
    share = np.asarray(load, dtype=float) / max(float(np.sum(load)), 1e-12)
    share = np.clip(share, 1e-6, None)
    gap = float(np.abs(np.log(share / share.mean())).max())
    return float(min(BOUNDS.bias_rate_max / 2, max(GAMMA, round(2 * gap / horizon, 4))))


def predicted_balancedness(load: np.ndarray, bias: np.ndarray) -> float:
    """Balancedness after a bias shift, under the same softmax model."""
    return balancedness(np.asarray(load, dtype=float) * np.exp(bias))


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
    out: list[Suggestion] = []
    for d in diagnoses:
        if d.serving_balancedness >= skew_below:
            continue
        load = serving.tokens[d.layer]
        bias = bias_correction(load)
        after = predicted_balancedness(load, bias)
        gamma = bias_rate(load)
        out.append(
            Suggestion(
                "router_bias",
                "training",
                d.layer,
                {"gamma": gamma, "bias": bias.round(4).tolist()},
                {
                    "balancedness_before": round(d.serving_balancedness, 3),
                    "balancedness_after": round(after, 3),
                },
                f"layer {d.layer}: experts {d.hot} take {sum(d.shares[e] for e in d.hot):.0%} of "
                f"serving tokens (balanced {len(load) and 1 / len(load):.0%} each); the aux-loss-free "
                f"bias update (DeepSeek-V3) shifts routing only, the gates stay, so the loss is not "
                f"pulled by a balancing term; a one-shot correction from the measured shares, then "
                f"sign updates with γ={gamma:g}"
                + (
                    ""
                    if gamma == GAMMA
                    else f" (DeepSeek-V3's {GAMMA:g} would take "
                    f"{np.abs(bias).max() / GAMMA:.0f} steps to move the bias as far as the shares "
                    f"say; this closes it within {HORIZON_STEPS})"
                ),
                control={"kind": "router_bias", "layer": d.layer, "values": [gamma, *bias.round(4).tolist()]},
            )
        )
        coef = float(model.get("aux_loss_coef", 0.01))
        new_coef = min(BOUNDS.aux_loss_coef_max, max(2 * coef, 1e-3))
        out.append(
            Suggestion(
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
        )
        factor = float(model.get("capacity_factor", 1.25))
        need = max(d.shares) * len(load)  # the hottest expert's share over the fair share
        if need > factor:
            new = min(BOUNDS.capacity_factor_max, round(need + 0.05, 2))
            out.append(
                Suggestion(
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
            )
        plan = place_experts(load, devices=devices, redundant=max(1, devices // 2))
        if plan.after <= plan.before + 0.01:  # the default layout is as good: nothing to move
            continue
        out.append(
            Suggestion(
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
        )
    for s in out:
        if kb is not None and "balancedness_after" in s.expected:
            # what such changes delivered before calibrates what this one promises
            b0, b1 = s.expected["balancedness_before"], s.expected["balancedness_after"]
            s.expected["balancedness_after"] = round(b0 + (b1 - b0) * kb.realised(s.cause, s.action), 3)
            s.expected["calibrated_by_outcomes"] = True
        s.score = _gain(s) * (kb.weight(s.cause, s.action) if kb is not None else 1.0)
    return sorted(out, key=lambda s: -s.score)


def _gain(s: Suggestion) -> float:
    e = s.expected
    if "balancedness_after" in e:
        return e["balancedness_after"] - e["balancedness_before"]
    if "device_balancedness_after" in e:
        return e["device_balancedness_after"] - e["device_balancedness_before"]
    return e.get("dropped_share_before", 0) - e.get("dropped_share_after", 0)


def _dropped(load: np.ndarray, factor: float) -> float:
    total = load.sum()
    cap = factor * total / len(load)
    return float(np.clip(load - cap, 0, None).sum() / total) if total > 0 else 0.0


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
    """Swap one slot of the busiest device with one of the idlest while it lowers the peak."""
    for _ in range(rounds):
        totals = [sum(w for w, _ in b) for b in bins]
        hi, lo = int(np.argmax(totals)), int(np.argmin(totals))
        gap = totals[hi] - totals[lo]
        best = None
        for i, (wi, _) in enumerate(bins[hi]):
            for j, (wj, _) in enumerate(bins[lo]):
                delta = wi - wj
                if 0 < delta < gap and (best is None or abs(gap - 2 * delta) < best[0]):
                    best = (abs(gap - 2 * delta), i, j)
        if best is None:
            return
        _, i, j = best
        bins[hi][i], bins[lo][j] = bins[lo][j], bins[hi][i]


def export_placement(suggestions: list[Suggestion], path: Path) -> Path:
    """Serving placements as one JSON file: per layer, each slot's logical expert and device
    (vLLM's physical_to_logical_map and SGLang's init_expert_location take this shape)."""
    layers = {
        str(s.layer): {
            "physical_to_logical_map": s.params["slot_expert"],
            "device_of_slot": s.params["device_of_slot"],
            "replicas": s.params["replicas"],
            "expected": s.expected,
        }
        for s in suggestions
        if s.action == "placement"
    }
    path.write_text(json.dumps({"format": "meshscope-placement/1", "layers": layers}, indent=1))
    return path


# --- apply ------------------------------------------------------------------------------------


def control_for(suggestion: dict[str, Any]) -> ControlChange:
    """The bounded change that applies a stored suggestion; ControlError when none does."""
    from meshscope.collector.controls import ControlError

    if not suggestion.get("control"):
        raise ControlError(
            f"suggestion {suggestion.get('action')!r} is for "
            f"{suggestion.get('target')}: export it, it does not change training"
        )
    return ControlChange.parse(suggestion["control"])


# --- learn ------------------------------------------------------------------------------------


def measure_outcome(
    steps: pd.DataFrame, experts: pd.DataFrame, applied_step: int, layer: int, after: int
) -> dict[str, Any] | None:
    """Balancedness, step time and loss in the `after` steps after a change against the
    `after` steps before it (from a run's steps and expert load); None until the run has gone
    `after` steps past it."""
    if steps.empty or steps["step"].max() < applied_step + after - 1:
        return None
    ex = experts
    if layer >= 0:
        ex = ex[ex["layer"] == layer]
    bal = (
        ex.groupby(["step", "layer"])["tokens"]
        .apply(lambda t: balancedness(t.to_numpy()))
        .groupby("step")
        .mean()
    )
    before = bal[(bal.index < applied_step) & (bal.index >= applied_step - after)]
    late = bal[(bal.index >= applied_step + after // 2) & (bal.index < applied_step + after)]
    per_step = steps.groupby("step").agg(step_s=("step_s", "max"), loss=("loss", "mean"))
    pre = per_step[(per_step.index < applied_step) & (per_step.index >= applied_step - after)]
    post = per_step[(per_step.index >= applied_step + after // 2) & (per_step.index < applied_step + after)]
    if before.empty or late.empty or pre.empty or post.empty:
        return None
    b0, b1 = float(before.mean()), float(late.mean())
    return {
        "balancedness_before": round(b0, 4),
        "balancedness_after": round(b1, 4),
        "balancedness_gain": round(b1 / b0 - 1, 4) if b0 > 0 else math.nan,
        "step_s_ratio": round(float(post["step_s"].median() / pre["step_s"].median()), 4),
        "loss_ratio": round(float(post["loss"].mean() / pre["loss"].mean()), 4),
        "steps": after,
    }


class KnowledgeBase:
    """cause → action → outcome, in SQLite beside the runs; ranks future suggestions."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._conn() as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS outcomes (id INTEGER PRIMARY KEY "
                "AUTOINCREMENT, time REAL, run TEXT, cause TEXT, action TEXT, "
                "params TEXT, predicted TEXT, measured TEXT, success INTEGER)"
            )

    def _conn(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        return conn

    def record(
        self, *, run: str, cause: str, action: str, params: dict, predicted: dict, measured: dict
    ) -> bool:
        """Store an outcome; success = balance rose and the loss is no more than 2 % worse."""
        success = measured.get("balancedness_gain", 0) > 0.05 and measured.get("loss_ratio", 2.0) <= 1.02
        with self._conn() as conn:
            conn.execute(
                "INSERT INTO outcomes (time, run, cause, action, params, predicted, "
                "measured, success) VALUES (?,?,?,?,?,?,?,?)",
                (
                    time.time(),
                    run,
                    cause,
                    action,
                    json.dumps(params),
                    json.dumps(predicted),
                    json.dumps(measured),
                    int(success),
                ),
            )
        return success

    def weight(self, cause: str, action: str) -> float:
        """How much to trust an action for a cause: (successes + 1) / (tries + 2)."""
        with self._conn() as conn:
            n, ok = conn.execute(
                "SELECT count(*), coalesce(sum(success), 0) FROM outcomes WHERE cause = ? AND action = ?",
                (cause, action),
            ).fetchone()
        return (ok + 1) / (n + 2) * 2  # 1.0 with no history

    def realised(self, cause: str, action: str) -> float:
        """The share of the predicted balancedness gain earlier outcomes actually delivered
        (1.0 with no history): what the next prediction is scaled by."""
        with self._conn() as conn:
            rows = conn.execute(
                "SELECT predicted, measured FROM outcomes WHERE cause = ? AND action = ?", (cause, action)
            ).fetchall()
        fractions = []
        for predicted, measured in rows:
            p, m = json.loads(predicted), json.loads(measured)
            hoped = p.get("balancedness_after", 0) - p.get("balancedness_before", 0)
            got = m.get("balancedness_after", 0) - m.get("balancedness_before", 0)
            if hoped > 1e-6:
                fractions.append(min(max(got / hoped, 0.0), 1.5))
        return float(np.mean(fractions)) if fractions else 1.0

    def table(self) -> pd.DataFrame:
        """Every outcome, newest first."""
        with self._conn() as conn:
            return pd.read_sql_query("SELECT * FROM outcomes ORDER BY id DESC", conn)


@dataclass
class FeedbackReport:
    """What one ingest produced: the diagnosis and the ranked suggestions."""

    source: str
    diagnoses: list[LayerDiagnosis]
    suggestions: list[Suggestion]
    event_ids: list[int] = field(default_factory=list)


# --- the loop, end to end (the CLI and the view call these) -----------------------------------


def knowledge_base(runs_dir: Path) -> KnowledgeBase:
    """The knowledge base shared by every run under `runs_dir`."""
    return KnowledgeBase(Path(runs_dir) / "knowledge.sqlite")


def ingest(
    run_dir: Path, data: bytes, name: str, *, devices: int = 8, kb: KnowledgeBase | None = None
) -> FeedbackReport:
    """Read a serving load, diagnose it against the run, store the suggestions as events."""
    from meshscope.collector.schema import Event
    from meshscope.collector.store import insert_events

    run_dir = Path(run_dir)
    serving = read_serving_load(data, name)
    diagnoses = diagnose(serving, training_load(run_dir))
    suggestions = suggest(diagnoses, serving, model=run_info(run_dir).model(), devices=devices, kb=kb)
    from meshscope.collector.store import latest_step

    step = latest_step(run_dir)
    step = step if step >= 0 else None
    ids = insert_events(
        run_dir,
        [
            Event(
                kind="suggestion",
                run_id=run_dir.name,
                step=step,
                detail={**s.as_dict(), "status": "proposed", "source": serving.source},
            )
            for s in suggestions
        ],
    )
    return FeedbackReport(serving.source, diagnoses, suggestions, ids)


def approve(run_dir: Path, suggestion_id: int) -> int:
    """A person approved suggestion `suggestion_id`: queue its bounded change; the control id."""
    from meshscope.collector import controls
    from meshscope.collector.store import load_events

    events = load_events(run_dir, kind="suggestion")
    row = events[events["id"] == suggestion_id]
    if row.empty:
        raise FeedbackError(
            f"no suggestion {suggestion_id} in {run_dir} (ids: {events['id'].tolist()[-10:] or 'none'})"
        )
    return controls.submit(run_dir, control_for(row.iloc[0]["detail"]), suggestion=suggestion_id)


def settle_outcomes(run_dir: Path, kb: KnowledgeBase, *, after: int) -> list[dict[str, Any]]:
    """Measure every applied change that has run `after` steps and has no outcome yet; store it
    on the change, as an `outcome` event and in the knowledge base."""
    from meshscope.collector import controls
    from meshscope.collector.schema import Event
    from meshscope.collector.store import insert_events, load_events

    run_dir = Path(run_dir)
    rows = controls.load_controls(run_dir)
    unsettled = rows[(rows["status"] == "applied") & rows["outcome"].isna()]
    if unsettled.empty:
        return []
    suggestions = {int(r["id"]): r["detail"] for _, r in load_events(run_dir, kind="suggestion").iterrows()}
    steps, experts = load_steps(run_dir), load_expert_load(run_dir)  # once for every change
    done = []
    for _, row in unsettled.iterrows():
        measured = measure_outcome(steps, experts, int(row["step"]), int(row["layer"]), after)
        if measured is None:
            continue
        s = suggestions.get(int(row["suggestion"])) if pd.notna(row["suggestion"]) else None
        cause = (s or {}).get("cause", "operator")
        action = (s or {}).get("action", row["kind"])
        predicted = (s or {}).get("expected", {})
        success = kb.record(
            run=run_dir.name,
            cause=cause,
            action=action,
            params={"values": row["payload"], "layer": int(row["layer"])},
            predicted=predicted,
            measured=measured,
        )
        outcome = {
            **measured,
            "success": success,
            "predicted": predicted,
            "control": int(row["id"]),
            "action": action,
        }
        controls.record_outcome(run_dir, int(row["id"]), outcome)
        insert_events(
            run_dir,
            [Event(kind="outcome", run_id=run_dir.name, step=int(row["step"]) + after, detail=outcome)],
        )
        done.append(outcome)
    return done
