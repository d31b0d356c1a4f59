"""What applied changes did: outcomes measured against their prediction, kept in a knowledge
base shared by the runs of one folder, so later suggestions are calibrated by them."""

from __future__ import annotations

import json
import math
import sqlite3
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from meshscope.collector.figures import balancedness


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

    def outcomes(self, cause: str, action: str) -> int:
        """How many measured outcomes of this action for this cause there are."""
        with self._conn() as conn:
            query = "SELECT count(*) FROM outcomes WHERE cause = ? AND action = ?"
            return int(conn.execute(query, (cause, action)).fetchone()[0])

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


def knowledge_base(runs_dir: Path) -> KnowledgeBase:
    """The knowledge base shared by every run under `runs_dir`."""
    return KnowledgeBase(Path(runs_dir) / "knowledge.sqlite")
