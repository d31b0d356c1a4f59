"""What an agent waits for when no step comes: said every `SAY_EVERY_S` while it lasts, so a
node that lost its peers never sits silent (which node went, since when, what happens next).

Read from this node's own files only (its workers' flight-log headers, its SQLite store, its
checkpoint folder): the job store or the other nodes may be what is gone."""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd

from meshscope.collector.flightread import latest_logs
from meshscope.collector.store import load_events
from meshscope.collector.storedb import NodeDir
from meshscope.config import RunConfig
from meshscope.watchdog.watch import pid_alive

SAY_EVERY_S = 10.0  # no step for this long: say what the agent waits for, and again as often


def _node_events(run_dir: Path):
    """This node's events (None while its store is not there or is being written)."""
    try:
        return load_events(NodeDir(run_dir))
    except Exception:  # no store yet, or one being written: nothing to say
        return None


def _finished(events) -> bool:
    """The job recorded its end after its last start: training is over here."""
    if events is None or events.empty:
        return False
    kinds = events["kind"].tolist()
    ends = [i for i, k in enumerate(kinds) if k == "run_end"]
    starts = [i for i, k in enumerate(kinds) if k == "run_start"]
    return bool(ends) and (not starts or ends[-1] > starts[-1])


def _last_fault(events) -> str:
    """The newest fault or hang this node recorded, as a user reads it ("" when none)."""
    if events is None:
        return ""
    bad = events[events["kind"].isin(("fault", "hang"))]
    if bad.empty:
        return ""
    row = bad.iloc[-1]
    d = row["detail"]
    ranks = d.get("culprit_ranks") or ([d["rank"]] if d.get("rank") is not None else [])
    who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else "a rank"
    at = f" at step {int(row['step'])}" if pd.notna(row["step"]) else ""
    age = time.time() - float(row["time"])
    return f"last fault: {who} {d.get('type', row['kind'])}{at}, {age:.0f} s ago"


def _newest_checkpoint(run_dir: Path) -> int | None:
    steps = []
    for path in (run_dir / "checkpoints").glob("step_*"):
        try:
            steps.append(int(path.name.removeprefix("step_")))
        except ValueError:
            continue
    return max(steps, default=None)


def waiting_line(cfg: RunConfig, idle_s: float, started: bool) -> str:
    """One line: no step for `idle_s`; whether this node's workers are up or the agent waits at
    the rendezvous (for how many nodes), the last fault, and the step the job resumes from.
    `started`: some step was done (else the workers may just be starting)."""
    live = cfg.run_dir / "live"
    heads = latest_logs(live) if live.is_dir() else {}
    up = sorted(r for r, h in heads.items() if not h.left and pid_alive(h.pid))
    events = _node_events(cfg.run_dir)
    if not up and _finished(events):
        return (
            f"training ended {idle_s:.0f} s ago; torchrun waits for the other nodes' agents to "
            "leave too (its exit barrier, up to 5 minutes: a node lost after its last step)"
        )
    if up and not started:
        what = f"{len(up)} worker(s) up on this node, before their first step"
    elif up:
        what = f"{len(up)} worker(s) up on this node: a peer is stuck or gone (the watchdog names it)"
    else:
        nnodes, where = cfg.elastic.nnodes, cfg.elastic.rdzv_endpoint or "the local rendezvous"
        least = nnodes.split(":")[0]
        what = f"no worker up here: waiting at {where} until {least} node(s) join (--nnodes {nnodes})"
    parts = [f"no step for {idle_s:.0f} s; {what}"]
    if fault := _last_fault(events):
        parts.append(fault)
    step = _newest_checkpoint(cfg.run_dir)
    parts.append("no checkpoint yet" if step is None else f"it resumes from the checkpoint of step {step}")
    return "; ".join(parts)
