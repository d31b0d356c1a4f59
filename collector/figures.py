"""The derived figures every reader shares, each said once: compute time, throughput, expert
balancedness. The engine, root cause, the view, the CLI summary and the feedback loop call these,
so they cannot blame different ranks or print different numbers for one run."""

from __future__ import annotations

from typing import Any

import numpy as np


def compute_seconds(step_s: Any, comm_exposed_s: Any, data_s: Any = 0.0) -> Any:
    """A rank's own work in a step: the step minus the wait for communication and for input
    (a rank starved by its data loader is not computing), never below zero."""
    return np.maximum(np.asarray(step_s) - np.asarray(comm_exposed_s) - np.asarray(data_s), 0.0)


def with_compute(steps: Any) -> Any:
    """A steps DataFrame with a `compute_s` column (`compute_seconds` of its rows)."""
    data = steps["data_s"] if "data_s" in steps else 0.0
    return steps.assign(compute_s=compute_seconds(steps["step_s"], steps["comm_exposed_s"], data))


def node_hops(steps: Any) -> Any:
    """Communication inside and across nodes, per (step, rank, hop), in seconds: only the rows
    whose reduction timed its hops apart (empty for a flat all-reduce or one node)."""
    import pandas as pd

    columns = {"comm_intra_s": "intra_node", "comm_inter_s": "inter_node"}
    if not set(columns).issubset(steps.columns):  # a store from before the hops were kept
        return pd.DataFrame(columns=["step", "rank", "hop", "seconds"])
    timed = steps.dropna(subset=list(columns))
    long = timed.melt(
        id_vars=["step", "rank"], value_vars=list(columns), var_name="hop", value_name="seconds"
    )
    return long.assign(hop=long["hop"].map(columns))


def tokens_per_second(steps: Any) -> float:
    """The job's training throughput: tokens of all ranks over the time the steps took, where a
    step lasts as long as its slowest rank (restarts and idle gaps between steps do not count)."""
    if steps.empty:
        return float("nan")
    per_step = steps.groupby("step").agg(tokens=("tokens", "sum"), step_s=("step_s", "max"))
    return float(per_step["tokens"].sum() / max(per_step["step_s"].sum(), 1e-9))


def balancedness(load: Any) -> Any:
    """Mean over max expert load along the last axis, as vLLM and SGLang report it: 1 when
    balanced, 1/E when one expert takes everything, and 1 when nothing was routed. A float for
    one layer's loads, an array for a matrix of them."""
    load = np.asarray(load, dtype=float)
    top = load.max(axis=-1)
    out = np.where(top > 0, load.mean(axis=-1) / np.where(top > 0, top, 1.0), 1.0)
    return float(out) if out.ndim == 0 else out


# When a wait is a stall, said once: a wait longer than STALL_STEP_FACTOR typical steps and
# longer than a floor. The floor depends on who asks: the live watchdog must not page on a
# checkpoint's pause (HANG_FLOOR_S, `--hang-after`), root cause looks back at recorded steps and
# may call a shorter wait a stall (STALL_FLOOR_S). The engine's `stall` anomaly is a step
# SLOW_STEP_FACTOR times its usual length and STALL_FLOOR_S longer (it has no wait to measure,
# only step times: a lone blip shorter than that is a retransmit or a busy host), and the
# Prometheus rule TrainingStalled is the backstop that knows no step time: no step in 3 minutes.
STALL_STEP_FACTOR = 20.0
HANG_FLOOR_S = 3.0
STALL_FLOOR_S = 1.0
SLOW_STEP_FACTOR = 10.0


def stall_threshold_s(
    typical_step_s: float, floor_s: float = HANG_FLOOR_S, factor: float = STALL_STEP_FACTOR
) -> float:
    """Seconds without progress that make a stall, given the typical step time (the floor
    alone while there is no step time yet)."""
    return max(floor_s, factor * typical_step_s) if typical_step_s > 0 else floor_s


def fault_tolerance_factor(steps: Any, retried: Any = None) -> float:
    """Productive time over wall time: the steps that count (each once, as long as its slowest
    rank took) over the span from the first step's start to the last one's end, every attempt
    included. Restarts, redone steps, hangs and pauses between steps are what it loses."""
    import pandas as pd

    if steps.empty:
        return float("nan")
    every = steps if retried is None or retried.empty else pd.concat([steps, retried], ignore_index=True)
    wall = float((every["time"] + every["step_s"]).max() - every["time"].min())
    productive = float(steps.groupby("step")["step_s"].max().sum())
    return min(productive / wall, 1.0) if wall > 0 else float("nan")


def comm_overhead(steps: Any) -> float:
    """The share of the job's step time spent waiting on communication (exposed, not hidden
    behind compute): one figure for the run summary and the TEI. Time-weighted, so a few long
    steps weigh as long as they took, not as one step each; over the timed steps (a Monitor
    may time one step in N: `monitor.detail_every`)."""
    timed = steps[steps["comm_exposed_s"].notna()]
    return float(timed["comm_exposed_s"].sum() / max(timed["step_s"].sum(), 1e-12))


# what a Monitor times on some steps only (`monitor.detail_every`): NaN on the others
UNTIMED_SHARES = ("comm_exposed_s", "data_s")


def fill_untimed(steps: Any) -> Any:
    """Steps a Monitor did not time in full take their rank's nearest timed step's shares of
    the step (the wait for communication, for data): an estimate each timed step stands for,
    for sums over every step (the time account). Steps all timed come back as they are."""
    timed = steps["comm_exposed_s"].notna() if "comm_exposed_s" in steps else None
    if timed is None or timed.all() or not timed.any():
        return steps
    out = steps.sort_values("step", kind="stable")
    keys = [out[k] for k in ("attempt", "rank") if k in out]
    for column in (c for c in UNTIMED_SHARES if c in out):
        share = (out[column] / out["step_s"]).where(out["comm_exposed_s"].notna())
        nearest = share.groupby(keys, sort=False).transform(lambda s: s.ffill().bfill())
        out[column] = out[column].fillna(nearest * out["step_s"])
    return out.loc[steps.index]


def training_efficiency_index(
    steps: Any, one_device_tokens_per_s: float, retried: Any = None, ettr: float | None = None
) -> dict[str, float]:
    """The Training Efficiency Index, TEI = scaling efficiency x (1 - communication overhead) x
    ETTR, with its parts. Scaling efficiency is the job's throughput over one device's
    (`one_device_tokens_per_s`, the same model and per-device batch on one device) times the
    devices; communication overhead is exposed communication over step time; ETTR is productive
    time over wall time (`collector.timeaccount`; without it, the fault-tolerance factor, which
    counts only the span of the steps). NaN parts where the run cannot say them."""
    if steps.empty:
        return {"tei": float("nan")}
    devices = int(steps["rank"].nunique())
    scaling = (
        tokens_per_second(steps) / (one_device_tokens_per_s * devices)
        if one_device_tokens_per_s > 0
        else float("nan")
    )
    comm = comm_overhead(steps)
    ft = fault_tolerance_factor(steps, retried)
    ratio = ft if ettr is None else ettr
    return {
        "tei": scaling * (1 - comm) * ratio,
        "scaling_efficiency": scaling,
        "comm_overhead": comm,
        "fault_tolerance": ft,
        "ettr": ratio,
    }
