"""A run's headline figures, computed from the store's DataFrames (pure functions)."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from meshscope.collector.env import HostShare
from meshscope.collector.figures import comm_overhead, node_hops, tokens_per_second


def expert_imbalance(expert_load: pd.DataFrame) -> pd.DataFrame:
    """Per (step, layer): max / mean expert tokens (1 = balanced)."""
    if expert_load.empty:
        return pd.DataFrame(columns=["step", "layer", "imbalance"])
    g = expert_load.groupby(["step", "layer"])["tokens"]
    out = (g.max() / g.mean()).rename("imbalance").reset_index()
    return out


def summarize(steps: pd.DataFrame, expert_load: pd.DataFrame | None = None) -> dict[str, float]:
    """Throughput, step-time mean/p99, communication overhead, compression ratio and expert imbalance."""
    if steps.empty:
        return {}
    wire = steps["bytes_wire"].sum()
    out = {
        "steps": float(steps["step"].nunique()),
        "ranks": float(steps["rank"].nunique()),
        "tokens_per_s": tokens_per_second(steps),
        "step_s_mean": float(steps["step_s"].mean()),
        "step_s_p99": float(steps["step_s"].quantile(0.99)),
        "comm_overhead": comm_overhead(steps),
        "compression_ratio": float(steps["bytes_raw"].sum() / wire) if wire > 0 else math.nan,
        "loss_first": float(steps.sort_values("step")["loss"].iloc[0]),
        "loss_last": float(steps.sort_values("step")["loss"].iloc[-1]),
    }
    out.update(across_nodes(steps))
    out.update(expert_exchange(steps))
    imb = expert_imbalance(expert_load if expert_load is not None else pd.DataFrame())
    out["expert_imbalance_max"] = float(imb["imbalance"].max()) if not imb.empty else math.nan
    out["expert_imbalance_mean"] = float(imb["imbalance"].mean()) if not imb.empty else math.nan
    return out


def across_nodes(steps: pd.DataFrame) -> dict[str, float]:
    """Gradient bytes a rank sent across nodes per step, and the share of the timed
    communication spent on the inter-node hop (NaN: not timed apart); empty on one node."""
    if "bytes_inter" not in steps or not steps["bytes_inter"].fillna(0).gt(0).any():
        return {}
    hops = node_hops(steps).groupby("hop")["seconds"].sum()
    timed = hops.sum()
    return {
        "inter_node_bytes_per_step": float(steps["bytes_inter"].mean()),
        "inter_node_time_share": float(hops.get("inter_node", 0.0) / timed) if timed > 0 else math.nan,
    }


def expert_exchange(steps: pd.DataFrame) -> dict[str, float]:
    """Expert parallelism's all-to-all: seconds and bytes per rank and step, and its share of
    the step; empty for a run without expert parallelism."""
    if "comm_a2a_s" not in steps or not steps["comm_a2a_s"].notna().any():
        return {}
    a2a = steps["comm_a2a_s"].fillna(0.0)
    return {
        "a2a_s_per_step": float(a2a.mean()),
        "a2a_bytes_per_step": float(steps["bytes_a2a"].mean()),
        "a2a_step_share": float(a2a.sum() / steps["step_s"].sum()) if steps["step_s"].sum() > 0 else math.nan,
    }


ABORT_WITHIN_S = 60.0  # a rank gone this long after the watchdog aborted the workers: the abort's


def watchdog_aborts(events: pd.DataFrame) -> list[float]:
    """When the hang watchdog aborted the workers on purpose (its hang events that say so)."""
    if events.empty:
        return []
    hangs = events[events["kind"] == "hang"]
    return [float(t) for t, d in zip(hangs["time"], hangs["detail"]) if d.get("action") == "abort"]


def after_abort(last_seen: float | None, aborts: list[float]) -> bool:
    """A rank last seen when the watchdog aborted the workers died of the abort, not a fault."""
    return last_seen is not None and any(t - 1.0 <= float(last_seen) <= t + ABORT_WITHIN_S for t in aborts)


def ranks_of(steps: pd.DataFrame, events: pd.DataFrame) -> int:
    """How many ranks the run had: the largest world rank 0 announced at a start, or the ranks
    that wrote steps (a node lost before its steps reached the job store still counts)."""
    wrote = int(steps["rank"].nunique()) if not steps.empty else 0
    if events.empty:
        return wrote
    starts = events.loc[events["kind"] == "run_start", "detail"]
    worlds = [d.get("world_size") for d in starts if isinstance(d, dict)]
    return max([wrote, *(int(w) for w in worlds if isinstance(w, int))])


def busiest_host(events: pd.DataFrame) -> HostShare | None:
    """The most shared node, from the `host` events each node writes as it starts (None: no
    such event, a store from before them)."""
    if events.empty:
        return None
    details = events.loc[events["kind"] == "host", "detail"]
    shares = [s for s in map(HostShare.from_detail, details) if s is not None]
    return max(shares, key=lambda s: s.factor, default=None)


def efficiency(
    run_dir: Any, steps: pd.DataFrame | None = None, events: pd.DataFrame | None = None
) -> dict[str, Any]:
    """The run's Training Efficiency Index on its time account: scaling efficiency (against the
    one-device run of the same model found beside it; `reference`: its name, or '' when there
    is none and scaling efficiency is NaN) x (1 - exposed communication share) x ETTR. The
    account itself is under `account`. `steps` and `events`: the run's, when the caller has
    read them already."""
    from meshscope.collector.figures import training_efficiency_index
    from meshscope.collector.rundir import one_device_reference
    from meshscope.collector.store import load_events, load_retried_steps, load_steps
    from meshscope.collector.timeaccount import time_account

    steps = load_steps(run_dir) if steps is None else steps
    retried = load_retried_steps(run_dir)
    events = load_events(run_dir) if events is None else events
    account = time_account(steps, retried, events)
    reference = one_device_reference(run_dir)
    one = tokens_per_second(load_steps(reference)) if reference is not None else math.nan
    out: dict[str, Any] = training_efficiency_index(steps, one, retried, ettr=account.ettr)
    out["reference"] = "" if reference is None else reference.name
    out["account"] = account
    return out


def efficiency_text(e: dict[str, Any]) -> str:
    """The TEI and its parts in one line (what the summary and the view print); a missing part
    is named, with how to get it, and the parts known are still multiplied."""
    if "comm_overhead" not in e:
        return "n/a (no steps)"
    parts = f"(1 - comm {e['comm_overhead']:.2f}) x ETTR {e['ettr']:.2f}"
    if not e["reference"]:
        known = (1 - e["comm_overhead"]) * e["ettr"]
        return (
            f"{parts} = {known:.2f} x scaling efficiency, which is missing: no one-device run of this "
            "model beside it (run the same config with `--nproc 1` in the same runs folder)"
        )
    return f"{e['tei']:.2f} = scaling {e['scaling_efficiency']:.2f} x {parts} (one device: {e['reference']})"
