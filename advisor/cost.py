"""The analytic cost model: step time and peak memory per device of every layout, from the
model's shapes, the cluster's peaks and a few efficiency factors (defaults, or fitted from
meshscope's own measurements by `calibrate`).

Formulas (all per optimizer step, per device):
- FLOPs/token = 6 N + 12 L h s (N: parameters a token touches; an expert counts top_k x
  capacity_factor times), plus a forward again under full recompute, attention's core again
  under selective recompute.
- Collectives over n devices at bandwidth B and per-hop latency a: ring all-reduce
  2(n-1)/n S/B + 2(n-1)a; all-gather, reduce-scatter and all-to-all (n-1)/n S/B + (n-1)a.
- Pipeline bubble (p-1)/v micro-batch times (1F1B, v interleaved chunks).
- Memory: 18 bytes/parameter with mixed-precision Adam, 6 + 12/d with a distributed optimizer
  over d replicas (fp32: 16, 8 + 8/d); activations s b h (34 + 5 a s/h) per layer at 16 bits
  (Korthikanti et al.), /t with TP and sequence parallelism, 34 s b h with selective recompute,
  2 s b h with full.
- Unbalanced routing: the rank holding the hottest experts computes, and receives in the
  all-to-all, `rank_skew` times the mean. No other planner models this; the skew comes from
  the model file or from a measured run's expert load.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from meshscope.advisor.specs import GIB, ClusterSpec, ModelSpec


class Factors(BaseModel):
    """How close the job gets to the cluster's peaks. Each field is a default until
    calibration replaces it; `measured` names those that came from runs."""

    model_config = ConfigDict(extra="forbid")

    compute_efficiency: float = Field(0.45, gt=0, le=1.5, description="achieved / peak matmul FLOP/s")
    step_overhead_s: float = Field(0.0, ge=0, description="fixed cost per step (launches, Python)")
    ep_step_overhead_s: float = Field(
        0.0,
        ge=0,
        description="extra fixed cost per step of expert-parallel layouts (the expert group's "
        "bookkeeping: routing metadata, more launches, more parameter groups)",
    )
    memory_efficiency: float = Field(
        0.7, gt=0, le=1.5, description="optimizer step: achieved / peak memory bandwidth"
    )
    allreduce_efficiency: float = Field(
        0.8, gt=0, le=1.5, description="all-reduce: achieved / link bandwidth"
    )
    alltoall_efficiency: float = Field(0.6, gt=0, le=1.5, description="all-to-all: achieved / link bandwidth")
    p2p_efficiency: float = Field(
        0.8, gt=0, le=1.5, description="pipeline send/recv: achieved / link bandwidth"
    )
    latency_scale: float = Field(1.0, ge=0, description="measured / stated per-hop latency")
    dp_overlap: float = Field(
        0.8,
        ge=0,
        le=1,
        description="seconds of gradient sync hidden per second of the last micro-batch's backward",
    )
    tp_overlap: float = Field(0.0, ge=0, le=1, description="share of TP collectives hidden")
    cp_overlap: float = Field(0.8, ge=0, le=1, description="share of context-parallel exchange hidden")
    a2a_overlap: float = Field(0.0, ge=0, le=1, description="share of the expert all-to-all hidden")
    a2a_call_s: float = Field(
        0.0, ge=0, description="fixed cost of one all-to-all call (launch, split exchange)"
    )
    allreduce_call_s: float = Field(
        0.0, ge=0, description="fixed cost of a step's gradient reduction (launches, buckets)"
    )
    ep_compute_scale: float = Field(
        1.0,
        gt=0,
        description="compute time of expert-parallel layouts / data-parallel ones (token permutation)",
    )
    dropless_compute_scale: float = Field(
        1.0,
        gt=0,
        description="compute time of dropless dispatch / capacity dispatch at equal FLOPs "
        "(tokens grouped per expert: a loop or grouped GEMM instead of one padded batch)",
    )
    rel_error: float = Field(0.25, gt=0, description="half-width of the prediction interval, relative")
    measured: dict[str, str] = Field(default_factory=dict, description="factor -> runs it was fitted on")
    rejected: dict[str, str] = Field(
        default_factory=dict, description="factor -> why its fitted value was not used"
    )
    assumed: dict[str, str] = Field(
        default_factory=dict,
        description="factor -> what its value stands on, set by a fit that could not measure it",
    )

    @classmethod
    def names(cls) -> list[str]:
        """The factors themselves (not the record of where they came from)."""
        return [n for n in cls.model_fields if n not in ("measured", "rejected", "assumed")]

    def source(self, name: str) -> str:
        """Where a factor's value came from."""
        if name in self.assumed:
            return f"assumed ({self.assumed[name]})"
        if name in self.measured:
            return f"measured ({self.measured[name]})"
        return f"default ({self.rejected[name]})" if name in self.rejected else "default"


# Bytes per parameter of weights, gradients and Adam state, and what a distributed optimizer
# keeps replicated (the rest is divided by the replicas).
STATE_BYTES = {"bf16": (18.0, 6.0), "fp32": (16.0, 8.0)}
ACT_BYTES = {"bf16": 2.0, "fp32": 4.0}
GRAD_BYTES = {"bf16": 2.0, "fp32": 4.0}
OPT_TRAFFIC = {"bf16": 30.0, "fp32": 28.0}  # bytes the optimizer reads and writes per parameter


def params(model: ModelSpec) -> dict[str, float]:
    """Parameter counts: dense (everything but routed experts), one expert, all routed experts,
    embeddings, and those a token's FLOPs touch."""
    h = model.hidden
    kv = h * (model.kv_heads or model.heads) // model.heads
    attn = h * (2 * h + 2 * kv) + 4 * h
    expert = model.ffn_matrices * h * model.expert_ffn
    embed = model.vocab * h * (1 if model.tied_embeddings else 2)
    moe_dense = model.shared_experts * expert + h * model.experts
    dense = (
        model.layers * attn
        + model.dense_layers * model.ffn_matrices * h * model.ffn
        + model.moe_layers * moe_dense
        + embed
    )
    routed = model.moe_layers * model.experts * expert
    head = model.vocab * h  # the input lookup is not a matmul; the output head is
    active_dense = dense - embed + head
    active_expert = model.moe_layers * model.top_k * model.capacity_factor * expert
    return {
        "dense": float(dense),
        "embed": float(embed),
        "expert": float(expert),
        "routed": float(routed),
        "active_dense": float(active_dense),
        "active_expert": float(active_expert),
    }


def rank_skew(model: ModelSpec, ep: np.ndarray) -> np.ndarray:
    """max/mean tokens per rank when E experts with max/mean `expert_skew` are spread over ep
    ranks, the hottest expert with the mean of the others beside it (1 without EP)."""
    e, sigma = model.experts, model.expert_skew
    ep = np.asarray(ep, dtype=float)
    if e <= 1:
        return np.ones_like(ep)
    per_rank = e / ep
    return (sigma + (per_rank - 1) * (e - sigma) / (e - 1)) / per_rank


def ring_allreduce(size: np.ndarray, n: np.ndarray, bw: np.ndarray, lat: np.ndarray) -> np.ndarray:
    """Seconds for a ring all-reduce of `size` bytes over n devices."""
    n = np.asarray(n, dtype=float)
    return np.where(n > 1, 2 * (n - 1) / n * size / bw + 2 * (n - 1) * lat, 0.0)


def ring_gather(size: np.ndarray, n: np.ndarray, bw: np.ndarray, lat: np.ndarray) -> np.ndarray:
    """Seconds for an all-gather, reduce-scatter or all-to-all of `size` bytes per device."""
    n = np.asarray(n, dtype=float)
    return np.where(n > 1, (n - 1) / n * size / bw + (n - 1) * lat, 0.0)


def _link(
    cluster: ClusterSpec, span: np.ndarray, efficiency: float, f: Factors
) -> tuple[np.ndarray, np.ndarray]:
    """(bytes/s, seconds per hop) of a group whose devices span `span` consecutive ranks."""
    span = np.asarray(span)
    group = cluster.devices_per_group or cluster.devices_per_node
    middle = cluster.pcie or cluster.intra
    levels = [span <= group, span <= cluster.devices_per_node]
    bw = np.select(levels, [cluster.intra.bandwidth_gbs, middle.bandwidth_gbs], cluster.inter.bandwidth_gbs)
    lat = np.select(levels, [cluster.intra.latency_us, middle.latency_us], cluster.inter.latency_us)
    return bw * 1e9 * efficiency, lat * 1e-6 * f.latency_scale


def _flops_per_token(
    model: ModelSpec, p: dict[str, float], recompute: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(all FLOPs, routed-expert FLOPs) per token, recompute included."""
    attn_core = 12.0 * model.layers * model.hidden * model.seq_len
    forward = 2 * (p["active_dense"] + p["active_expert"]) + attn_core / 3
    extra = np.select([recompute == 2, recompute == 1], [forward, attn_core / 3], 0.0)
    dense = 6 * (p["active_dense"] + p["active_expert"]) + attn_core
    expert_share = 6 * p["active_expert"] * np.select([recompute == 2], [4 / 3], 1.0)
    return dense + extra, expert_share


def _compute(
    frame: pd.DataFrame, model: ModelSpec, cluster: ClusterSpec, f: Factors
) -> dict[str, np.ndarray]:
    p = params(model)
    world = frame.tp * frame.pp * frame.cp * frame.dp
    per_token, expert_part = _flops_per_token(model, p, frame.recompute.to_numpy())
    tokens = model.global_batch * model.seq_len
    skew = rank_skew(model, frame.ep.to_numpy())
    flops = tokens * (per_token + expert_part * (skew - 1)) / world
    compute = flops / (cluster.device.peak_tflops * 1e12 * f.compute_efficiency)
    compute = np.where(frame.ep > 1, compute * f.ep_compute_scale, compute)
    if model.dispatch == "dropless":
        compute = compute * f.dropless_compute_scale
    dense_dev = (p["dense"] - p["embed"]) / (frame.pp * frame.tp) + np.where(
        frame.pp == 1, p["embed"], model.vocab * model.hidden
    ) / frame.tp
    routed_dev = p["routed"] / (frame.pp * frame.ep)
    replicas = (frame.dp * frame.cp).to_numpy()
    stepped = np.where(
        frame.dist_opt, dense_dev / replicas + routed_dev / (replicas / frame.ep), dense_dev + routed_dev
    )
    opt = (
        stepped
        * OPT_TRAFFIC[model.precision]
        / (cluster.device.memory_bandwidth_gbs * 1e9 * f.memory_efficiency)
    )
    return {
        "compute_s": np.asarray(compute, dtype=float),
        "optimizer_s": np.asarray(opt, dtype=float),
        "rank_skew": skew,
        "dense_params": np.asarray(dense_dev, dtype=float),
        "expert_params": np.asarray(routed_dev, dtype=float),
    }


def _communication(
    frame: pd.DataFrame, model: ModelSpec, cluster: ClusterSpec, f: Factors, c: dict
) -> dict[str, np.ndarray]:
    """Exposed seconds of each kind of communication a layout adds."""
    tp, pp, cp, dp, ep, mb, m = (
        frame[k].to_numpy(dtype=float) for k in ("tp", "pp", "cp", "dp", "ep", "mb", "m")
    )
    full = (frame.recompute == 2).to_numpy()
    act = ACT_BYTES[model.precision]
    tokens_mb = mb * model.seq_len / cp  # tokens a device holds per micro-batch
    layers_stage = model.layers / pp
    kv = model.hidden * (model.kv_heads or model.heads) / model.heads

    bw, lat = _link(cluster, tp, f.allreduce_efficiency, f)
    n_tp = m * layers_stage * np.where(full, 6, 4)
    tp_s = n_tp * ring_allreduce(tokens_mb * model.hidden * act, tp, bw, lat) * (1 - f.tp_overlap)

    bw, lat = _link(cluster, tp * cp, f.p2p_efficiency, f)
    cp_s = (
        m
        * layers_stage
        * 3
        * ring_gather(tokens_mb * 2 * kv * act / tp * cp, cp, bw, lat)
        * (1 - f.cp_overlap)
    )

    bw, lat = _link(cluster, tp * cp * dp * pp, f.p2p_efficiency, f)
    p2p = tokens_mb * model.hidden * act / tp / bw + lat
    pp_s = np.where(pp > 1, 2 * frame.v * (m + pp - 1) * p2p, 0.0)

    moe_stage = model.moe_layers / pp
    bw, lat = _link(cluster, tp * ep, f.alltoall_efficiency, f)
    a2a_bytes = tokens_mb * model.top_k * model.capacity_factor * model.hidden * act / tp
    n_a2a = m * moe_stage * np.where(full, 6, 4)
    n_a2a = np.where(ep > 1, n_a2a, 0.0)
    per_call = ring_gather(a2a_bytes, ep, bw, lat) * c["rank_skew"] + f.a2a_call_s
    a2a_s = n_a2a * per_call * (1 - f.a2a_overlap)

    grad = GRAD_BYTES[model.precision]
    bw, lat = _link(cluster, tp * cp * dp, f.allreduce_efficiency, f)
    sync = ring_allreduce(c["dense_params"] * grad, dp * cp, bw, lat)
    sync = sync + ring_allreduce(c["expert_params"] * grad, dp * cp / ep, bw, lat)
    sync = sync + np.where(dp * cp > 1, f.allreduce_call_s, 0.0)
    dp_s = np.maximum(sync - f.dp_overlap * backward_window(c["compute_s"], m), 0.0)
    return {
        "tp_s": tp_s,
        "cp_s": cp_s,
        "pp_s": pp_s,
        "a2a_s": a2a_s,
        "a2a_calls": n_a2a,
        "dp_s": dp_s,
        "dp_total_s": sync,
    }


def backward_window(compute_s: np.ndarray, m: np.ndarray) -> np.ndarray:
    """What a gradient reduction can hide behind: the last micro-batch's backward (two thirds
    of its compute); earlier micro-batches accumulate without reducing."""
    return (2 / 3) * np.asarray(compute_s) / np.asarray(m)


def _memory(frame: pd.DataFrame, model: ModelSpec, cluster: ClusterSpec, c: dict) -> np.ndarray:
    """Peak bytes per device on the busiest pipeline stage."""
    tp, pp, cp, dp, ep, mb, m, v = (
        frame[k].to_numpy(dtype=float) for k in ("tp", "pp", "cp", "dp", "ep", "mb", "m", "v")
    )
    rc = frame.recompute.to_numpy()
    full_b, kept_b = STATE_BYTES[model.precision]
    dense_rep, expert_rep = dp * cp, dp * cp / ep
    per_param_d = np.where(frame.dist_opt, kept_b + (full_b - kept_b) / dense_rep, full_b)
    per_param_e = np.where(frame.dist_opt, kept_b + (full_b - kept_b) / expert_rep, full_b)
    states = c["dense_params"] * per_param_d + c["expert_params"] * per_param_e

    s, h, scale = model.seq_len / cp, model.hidden, ACT_BYTES[model.precision] / 2
    base = s * mb * h
    mlp_dense = 19 * base * model.ffn * model.ffn_matrices / (8 * h)
    mlp_moe = (
        19
        * base
        * model.expert_ffn
        * model.ffn_matrices
        / (8 * h)
        * (model.top_k * model.capacity_factor + model.shared_experts)
    )
    moe_share = model.moe_layers / model.layers
    mlp = moe_share * mlp_moe + (1 - moe_share) * mlp_dense
    layer = (15 * base + mlp) / tp + 5 * model.heads * s * s * mb / tp * (rc == 0)
    per_layer = np.where(rc == 2, 2 * base / tp, layer)
    inflight = np.where(v > 1, pp * (1 + (pp - 1) / (pp * v)), np.minimum(pp, m))
    acts = (model.layers / pp * per_layer * inflight + np.where(rc == 2, layer, 0.0)) * scale
    logits = s * mb * model.vocab * 4 / tp
    return states + acts + logits + cluster.device.reserved_gib * GIB


def predict(frame: pd.DataFrame, model: ModelSpec, cluster: ClusterSpec, f: Factors) -> pd.DataFrame:
    """`frame` (layouts) with the predicted breakdown, step time, interval and memory."""
    c = _compute(frame, model, cluster, f)
    comm = _communication(frame, model, cluster, f, c)
    staged = c["compute_s"] + comm["tp_s"] + comm["cp_s"] + comm["a2a_s"]
    bubble = (frame.pp.to_numpy() - 1) / frame.v.to_numpy() * staged / frame.m.to_numpy()
    exposed = comm["tp_s"] + comm["cp_s"] + comm["pp_s"] + comm["dp_s"]
    overhead = f.step_overhead_s + np.where(frame.ep.to_numpy() > 1, f.ep_step_overhead_s, 0.0)
    step = staged + comm["pp_s"] + comm["dp_s"] + bubble + c["optimizer_s"] + overhead
    out = frame.copy()
    out["compute_s"] = c["compute_s"]
    out["comm_exposed_s"] = exposed
    out["a2a_s"] = comm["a2a_s"]
    out["grad_sync_s"] = comm["dp_total_s"]  # all of it, hidden or not
    out["a2a_calls"] = comm["a2a_calls"]
    out["bubble_s"] = bubble
    out["other_s"] = c["optimizer_s"] + overhead
    out["step_s"] = step
    out["step_lo_s"] = step / (1 + f.rel_error)
    out["step_hi_s"] = step * (1 + f.rel_error)
    out["comm_ratio"] = (exposed + comm["a2a_s"]) / step
    out["rank_skew"] = c["rank_skew"]
    out["memory_gib"] = _memory(frame, model, cluster, c) / GIB
    out["tokens_per_s"] = model.global_batch * model.seq_len / step
    return out


PARTS = {
    "compute_s": "compute",
    "comm_exposed_s": "exposed communication",
    "a2a_s": "expert all-to-all",
    "bubble_s": "pipeline bubble",
    "other_s": "optimizer and overhead",
}
