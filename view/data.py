"""What the view shows, computed from run stores: pure functions, no Streamlit (tested alone).

Everything is read-only: the view never writes a run's store except through the feedback
loop's controls (detectors/feedback.py), and only when a person approves.
"""

from __future__ import annotations

import math
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import numpy as np
import pandas as pd

from meshscope.collector.figures import balancedness as balancedness_of
from meshscope.collector.figures import tokens_per_second, with_compute
from meshscope.collector.report import after_abort, ranks_of, watchdog_aborts
from meshscope.collector.rundir import STORE_LOCATOR
from meshscope.collector.schema import anomaly_link
from meshscope.collector.store import (
    has_store,
    load_events,
    load_retried_steps,
    load_steps,
    store_path,
    store_version,  # noqa: F401  (the screens key their caches on it)
)
from meshscope.explain.facts import Anomaly, RunFacts

LIVE_WITHIN_S = 30.0  # a run whose store changed this recently is shown as running
# Alert names (Prometheus rules and embedded alerts) -> the anomaly types they stand for.
ALERT_TYPES = {
    "StragglerRank": {"straggler"},
    "CommRatioHigh": {"comm"},
    "ExpertImbalance": {"expert_imbalance"},
    "LossNotFinite": {"nan"},
    "AnomalyDetected": None,
    "HangDetected": {"hang"},
    "TrainingStalled": {"hang", "stall"},
}


def run_dirs(runs_dir: Path) -> list[Path]:
    """Run directories under `runs_dir` (those with a store), newest first."""
    if not runs_dir.is_dir():
        return []
    found = [p for p in runs_dir.iterdir() if has_store(p)]
    return sorted(found, key=_last_written, reverse=True)


def _last_written(run_dir: Path) -> float:
    """When the run's store (or, on a job store, its locator) last changed on this disk."""
    files = [store_path(run_dir), run_dir / STORE_LOCATOR]
    return max((f.stat().st_mtime for f in files if f.exists()), default=0.0)


def run_summary(run_dir: Path) -> dict[str, Any]:
    """One row of the Runs page: health, throughput and faults at a glance."""
    row: dict[str, Any] = {"run": run_dir.name}
    try:
        steps, events = load_steps(run_dir), load_events(run_dir)
    except (FileNotFoundError, sqlite3.DatabaseError, pd.errors.DatabaseError) as err:
        return {**row, "status": f"unreadable ({err})"}
    kinds = events["kind"].value_counts().to_dict() if len(events) else {}
    ended = bool(kinds.get("run_end"))
    updated = _last_activity(run_dir, steps, events)
    # the store's version is a cache key (a sum of counters on a job store), not a time
    fresh = pd.notna(updated) and time.time() - updated.timestamp() < LIVE_WITHIN_S
    status = "finished" if ended else "running" if fresh else "stopped"
    if not ended and (kinds.get("hang") or kinds.get("fault")):
        status = "failed" if not fresh else "recovering"
    if ended and steps.empty:
        status = "ended before its first step"
    row.update(
        status=status,
        ranks=ranks_of(steps, events),
        steps=int(steps["step"].max()) + 1 if len(steps) else 0,
        step_s_p50=float(steps["step_s"].median()) if len(steps) else math.nan,
        tokens_per_s=tokens_per_second(steps),
        loss=float(steps.sort_values("step")["loss"].iloc[-1]) if len(steps) else math.nan,
        anomalies=int(kinds.get("anomaly", 0)),
        hangs=int(kinds.get("hang", 0)),
        nans=int(kinds.get("nan", 0)),
        faults=int(kinds.get("fault", 0)),
        restarts=int(kinds.get("restart", 0)),
        updated=updated,
    )
    return row


def _last_activity(run_dir: Path, steps: pd.DataFrame, events: pd.DataFrame) -> pd.Timestamp:
    """When the run last wrote a step or an event (the store file's time where it has none;
    NaT, shown blank, rather than 1970 when there is nothing)."""
    times = [t["time"].max() for t in (steps, events) if len(t) and "time" in t]
    last = max((float(t) for t in times if pd.notna(t)), default=_last_written(run_dir) or math.nan)
    return pd.Timestamp(last, unit="s") if not math.isnan(last) else pd.NaT


def redone_steps(run_dir: Path, steps: pd.DataFrame) -> pd.DataFrame:
    """Every attempt's rows at the steps a restart redid: the earlier attempts' (kept apart in
    the store) beside the one that completed them, so a recovered fault keeps its trace."""
    earlier = load_retried_steps(run_dir)
    if earlier.empty:
        return earlier
    redone = pd.MultiIndex.from_frame(earlier[["rank", "step"]])
    completed = steps[pd.MultiIndex.from_frame(steps[["rank", "step"]]).isin(redone)]
    both = with_compute(pd.concat([earlier, completed], ignore_index=True))
    return both.assign(attempt=both["attempt"].astype(int).astype(str), rank=both["rank"].astype(str))


def runs_table(runs_dir: Path) -> pd.DataFrame:
    """Every run under `runs_dir`, newest first."""
    return pd.DataFrame([run_summary(d) for d in run_dirs(runs_dir)])


def timeline(events: pd.DataFrame) -> pd.DataFrame:
    """Events as one timeline: step, kind, severity, rank and a one-line summary."""
    if events.empty:
        return pd.DataFrame(columns=["id", "step", "kind", "severity", "rank", "summary"])
    out = events.copy()
    out["summary"] = [summarize_detail(k, d) for k, d in zip(out["kind"], out["detail"])]
    out["step"] = out["step"].fillna(-1).astype(int)
    # a fault is about the rank it names, not the rank that noticed it
    about = [d.get("rank") if k == "fault" else None for k, d in zip(out["kind"], out["detail"])]
    out["rank"] = [r if a is None else a for r, a in zip(out["rank"], about)]
    aborted = watchdog_aborts(events)
    for i, (kind, d) in enumerate(zip(out["kind"], out["detail"])):
        seen = d.get("last_seen") or d.get("detected_at")
        if kind == "fault" and d.get("type") == "dead_rank" and after_abort(seen, aborted):
            out.iloc[i, out.columns.get_loc("severity")] = "info"  # meshscope's own doing
            out.iloc[i, out.columns.get_loc("summary")] = (
                "stopped by the hang watchdog on purpose (see the hang)"
            )
    return out[["id", "step", "kind", "severity", "rank", "summary"]]


def _when(value: Any) -> str:
    """An epoch time as a UTC clock time."""
    return time.strftime("%H:%M:%S", time.gmtime(float(value))) + f".{int(float(value) % 1 * 10)}Z"


def summarize_detail(kind: str, d: dict[str, Any]) -> str:
    """One line for an event's detail."""
    if kind == "anomaly":
        where = "".join(
            f" {k}={d[k]}" for k in ("ranks", "layer", "expert", "module") if d.get(k) not in (None, [])
        )
        return f"{d.get('type')}{where} steps {d.get('start_step')}–{d.get('end_step')}"
    if kind == "hang":
        return f"{d.get('type')}: culprit {d.get('culprit_ranks')} — {d.get('why', '')}"
    if kind == "nan":
        return f"{d.get('module') or d.get('what')} {d.get('where', '')} {d.get('value', '')}"
    if kind in ("suggestion", "suggestion_applied"):
        return f"{d.get('action')} {d.get('target', '')} {d.get('status', '')}"
    if kind == "checkpoint" and "held_s" in d:
        return f"saved step {d.get('saved_step')}, held the step {d['held_s']:.2f} s"
    if kind == "fault":
        return f"{d.get('type')} rank {d.get('rank')}: {d.get('how') or d.get('why') or ''}".rstrip(": ")
    shown = [
        (k, _when(v) if k.endswith(("_at", "_seen", "time")) and _is_epoch(v) else v) for k, v in d.items()
    ]
    return ", ".join(f"{k}={v}" for k, v in shown[:4])


def _is_epoch(value: Any) -> bool:
    return isinstance(value, (int, float)) and value > 1e9


def anomalies_with_hangs(facts: RunFacts) -> list[Anomaly]:
    """The run's anomalies and its hang diagnoses, as one list to drill into (by event id)."""
    out = list(facts.anomalies)
    hangs = facts.events[facts.events["kind"] == "hang"]
    for _, row in hangs.iterrows():
        d = row["detail"]
        step = int(row["step"]) if not pd.isna(row["step"]) else int(d.get("step", -1) or -1)
        out.append(
            Anomaly(
                int(row["id"]),
                "hang",
                list(d.get("culprit_ranks") or []),
                step,
                step,
                1.0,
                evidence={"why": d.get("why"), "op": d.get("op"), "seq": d.get("seq")},
                severity="critical",
            )
        )
    return sorted(out, key=lambda a: (a.start_step, a.id or 0))


def resolve_link(params: dict[str, str], anomalies: list[Anomaly]) -> Anomaly | None:
    """The anomaly a deep link points at: `anomaly=EVENT_ID`; or `type=T&start=S` (an alert
    sent before the episode was stored); or `alert=NAME[&rank=R][&layer=L][&step=S]` (the
    latest anomaly of that alert's kind there). None when nothing matches."""
    if params.get("anomaly", "").lstrip("-").isdigit():
        wanted = int(params["anomaly"])
        return next((a for a in anomalies if a.id == wanted), None)
    kinds: set[str] | None = None
    if params.get("type"):
        kinds = {params["type"]}
    elif params.get("alert") in ALERT_TYPES:
        kinds = ALERT_TYPES[params["alert"]]
    elif not params.get("alert"):
        return None
    found = [a for a in anomalies if kinds is None or a.type in kinds]
    if params.get("rank", "").isdigit():
        found = [a for a in found if not a.ranks or int(params["rank"]) in a.ranks] or found
    if params.get("layer", "").isdigit():
        found = [a for a in found if a.layer is None or a.layer == int(params["layer"])] or found
    for key in ("start", "step"):
        if params.get(key, "").lstrip("-").isdigit():
            at = int(params[key])
            near = [a for a in found if a.start_step <= at <= max(a.end_step, a.start_step)]
            found = near or sorted(found, key=lambda a: abs(a.start_step - at))[:1]
    return found[-1] if found else None


def link_query(run: str, anomaly: Anomaly | None = None) -> str:
    """The query string of a drill-down state (what alerts and the pages link to)."""
    params = {"run": run}
    if anomaly is not None and anomaly.id is not None:
        params["anomaly"] = str(anomaly.id)
    elif anomaly is not None:
        params.update(anomaly_link({"type": anomaly.type, "start_step": anomaly.start_step}))
    return urlencode(params)


def window(steps: pd.DataFrame, anomaly: Anomaly, margin: int = 20) -> pd.DataFrame:
    """The steps around an anomaly, for the drill-down charts."""
    lo, hi = anomaly.start_step - margin, max(anomaly.end_step, anomaly.start_step) + margin
    return steps[(steps["step"] >= lo) & (steps["step"] <= hi)]


def ranks_compared(steps: pd.DataFrame, anomaly: Anomaly) -> pd.DataFrame:
    """Per rank, inside the anomaly against before it: step, compute, exposed comm, memory."""
    lo, hi = anomaly.start_step, max(anomaly.end_step, anomaly.start_step)
    s = with_compute(steps)
    cols = ["step_s", "compute_s", "comm_exposed_s", "mem_rss"]
    inside = s[(s["step"] >= lo) & (s["step"] <= hi)].groupby("rank")[cols].median()
    before = s[(s["step"] < lo) & (s["step"] >= lo - 30)].groupby("rank")[cols].median()
    out = inside.merge(before, how="left", left_index=True, right_index=True, suffixes=("", "_before"))
    out["step_x"] = out["step_s"] / out["step_s_before"].clip(lower=1e-9)
    out["flagged"] = [int(r) in anomaly.ranks for r in out.index]
    return out.reset_index()


def related_events(events: pd.DataFrame, anomaly: Anomaly, margin: int = 10) -> pd.DataFrame:
    """Faults, hangs, NaNs, snapshots and restarts near an anomaly."""
    lo, hi = anomaly.start_step - margin, max(anomaly.end_step, anomaly.start_step) + margin
    near = events[
        events["kind"].isin(
            [
                "fault",
                "hang",
                "nan",
                "snapshot",
                "restart",
                "resume",
                "injected",
                "suggestion",
                "suggestion_applied",
            ]
        )
    ]
    near = near[near["step"].isna() | ((near["step"] >= lo) & (near["step"] <= hi))]
    return timeline(near)


def grafana_link(
    base: str | None, run: str, anomaly: Anomaly | None, steps: pd.DataFrame, board: str = "meshscope-faults"
) -> str | None:
    """The Grafana board of the run, zoomed on the anomaly's time (None without Grafana)."""
    if not base:
        return None
    params: dict[str, Any] = {"var-run": run}
    if anomaly is not None and not steps.empty:
        span = window(steps, anomaly, margin=10)
        if not span.empty:
            params["from"] = int(span["time"].min() * 1000) - 30_000
            params["to"] = int(span["time"].max() * 1000) + 30_000
    return f"{base.rstrip('/')}/d/{board}?{urlencode(params)}"


@dataclass
class ExpertView:
    """One layer's routing over time: shares, balancedness and estimated drops."""

    shares: pd.DataFrame  # index step, columns expert
    balancedness: pd.Series  # mean / max load per step (1 = balanced)
    dropped: pd.Series  # estimated share of routed tokens over capacity per step


def expert_view(
    experts: pd.DataFrame, layer: int, *, capacity_factor: float | None, ranks: int, steps_per_window: int
) -> ExpertView:
    """Shares, balancedness and the tokens over capacity (estimated: each rank's counts taken
    as an equal part of the window's; the model drops what exceeds factor x fair share)."""
    rows = experts[experts["layer"] == layer]
    counts = rows.pivot_table(index="step", columns="expert", values="tokens", aggfunc="sum")
    total = counts.sum(axis=1).replace(0, np.nan)
    shares = counts.div(total, axis=0).fillna(0.0)
    bal = counts.mean(axis=1) / counts.max(axis=1).replace(0, np.nan)
    if capacity_factor:
        n = counts.shape[1]
        capacity = capacity_factor * total / n  # factor x the fair share, summed over the window
        over = counts.sub(capacity, axis=0).clip(lower=0).sum(axis=1)
        dropped = (over / total).fillna(0.0)
    else:
        dropped = pd.Series(0.0, index=counts.index)
    return ExpertView(shares, bal.fillna(1.0), dropped)


def balancedness(experts: pd.DataFrame) -> pd.DataFrame:
    """Per (layer, step): mean / max expert load (`figures.balancedness`)."""
    g = experts.groupby(["layer", "step"])["tokens"]
    out = g.apply(lambda t: balancedness_of(t.to_numpy())).rename("balancedness")
    return out.reset_index()


LIVE_QUERIES = {
    "steps_per_s": 'rate(meshscope_steps_total{{run="{run}"}}[1m])',
    "comm_ratio": 'meshscope_comm_ratio{{run="{run}"}}',
    "loss": 'meshscope_loss{{run="{run}"}}',
    "rss_bytes": 'meshscope_memory_bytes{{run="{run}",kind="rss"}}',
}


def live_metrics(prometheus_url: str, run: str, timeout_s: float = 3.0) -> pd.DataFrame:
    """The run's current per-rank figures from Prometheus (for a run still training); raises
    OSError with the reason when Prometheus does not answer."""
    import requests

    rows: dict[str, dict[str, float]] = {}
    for name, query in LIVE_QUERIES.items():
        try:
            resp = requests.get(
                f"{prometheus_url.rstrip('/')}/api/v1/query",
                params={"query": query.format(run=run)},
                timeout=timeout_s,
            )
            resp.raise_for_status()
            result = resp.json()["data"]["result"]
        except (requests.RequestException, ValueError, KeyError) as err:
            raise OSError(f"Prometheus at {prometheus_url}: {err}") from None
        for r in result:
            rows.setdefault(r["metric"].get("rank", "?"), {})[name] = float(r["value"][1])
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("rank").reset_index()


def exists(run_dir: Path) -> bool:
    """A run the view can open."""
    return has_store(run_dir)


def evidence_rows(evidence: dict[str, Any]) -> pd.DataFrame:
    """An anomaly's evidence as rows people read: a per-rank figure is one row per rank, a
    number is rounded, a list is joined (instead of raw JSON)."""
    rows = []
    for key, value in (evidence or {}).items():
        what = key.replace("_", " ")
        if isinstance(value, dict):
            for sub, v in value.items():
                label = f"rank {sub}" if str(sub).isdigit() else str(sub).replace("_", " ")
                rows.append({"what": f"{what}, {label}", "value": _readable(v)})
        else:
            rows.append({"what": what, "value": _readable(value)})
    return pd.DataFrame(rows, columns=["what", "value"])


def _readable(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_readable(v) for v in value)
    return str(value)
