"""The maturity level a run reached, L1 to L5, from what was on and what worked in it.

The levels are cumulative (a run is at the highest level whose evidence it holds along with
every level below), and each is read from the store and the run folder, never from intent:
- L1 data parallel: two or more ranks stepped together;
- L2 communication made cheaper: gradient compression, or reduction overlapped with backward;
- L3 elastic: a restart resumed from a checkpoint and training went on after it;
- L4 watched: live detection ran beside the job (its endpoint in the run's targets), or
  anomalies and hangs were judged while it ran;
- L5 adaptive: a change suggested from what was measured (an expert re-placement, a router
  bias, a capacity) was applied in flight and its outcome measured (the feedback loop closed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from meshscope.collector.exporter import DETECTOR_JOB
from meshscope.collector.rundir import run_config
from meshscope.collector.timeaccount import events_of

LEVELS = (
    ("L1", "data parallel", "run on two or more ranks (`--nproc 2`)"),
    (
        "L2",
        "communication made cheaper",
        "compress gradients (`--compression fp16`) or keep `train.overlap` on",
    ),
    (
        "L3",
        "elastic restarts that resume",
        "checkpoint (`--checkpoint-every N`) and allow restarts (`--max-restarts 1`)",
    ),
    (
        "L4",
        "live detection and diagnosis",
        "run through `meshscope run` (its sidecar judges live), or `meshscope hang-watch --run DIR` beside",
    ),
    (
        "L5",
        "adaptive re-placement and the feedback loop",
        "approve a suggestion (`meshscope feedback apply`), then measure it (`meshscope feedback outcomes`)",
    ),
)


@dataclass
class Maturity:
    """The level reached (0 when not even L1), the evidence of each level held, and what the
    next level needs."""

    level: int
    evidence: dict[str, str]
    next_needs: str

    def text(self) -> str:
        """One line: the level, its name, and what the next one needs."""
        if self.level == 0:
            return f"L0: not yet data parallel; L1 needs: {LEVELS[0][2]}"
        name = LEVELS[self.level - 1][1]
        nxt = f"; L{self.level + 1} needs: {self.next_needs}" if self.level < len(LEVELS) else ""
        return f"L{self.level} ({name}){nxt}"


def maturity(run_dir: Any, steps: pd.DataFrame, events: pd.DataFrame) -> Maturity:
    """The level `run_dir` reached, from its steps, events, config and targets (module doc)."""
    checks = (_data_parallel, _cheaper_comm, _elastic, _watched, _adaptive)
    evidence: dict[str, str] = {}
    level = 0
    for (name, _, needs), check in zip(LEVELS, checks, strict=True):
        found = check(Path(run_dir), steps, events)
        if not found:
            return Maturity(level, evidence, needs)
        evidence[name] = found
        level += 1
    return Maturity(level, evidence, "")


def _data_parallel(run_dir: Path, steps: pd.DataFrame, events: pd.DataFrame) -> str:
    ranks = int(steps["rank"].nunique()) if not steps.empty else 0
    return f"{ranks} ranks stepped" if ranks >= 2 else ""


def _cheaper_comm(run_dir: Path, steps: pd.DataFrame, events: pd.DataFrame) -> str:
    compression = {d.get("compression") for d in events_of(events, "run_start")["detail"]} - {
        None,
        "none",
        "",
    }
    if compression:
        return f"compression {', '.join(sorted(compression))}"
    train = run_config(run_dir).get("train")
    if isinstance(train, dict) and train.get("overlap") is True:
        return "bucketed all-reduce overlapped with backward"
    return ""


def _elastic(run_dir: Path, steps: pd.DataFrame, events: pd.DataFrame) -> str:
    resumes = events_of(events, "resume")
    if resumes.empty or steps.empty:
        return ""
    first = float(resumes["time"].min())
    after = steps[steps["time"] > first]
    return (
        f"resumed from step {int(resumes['step'].min())}, {after['step'].nunique()} steps after"
        if len(after)
        else ""
    )


def _watched(run_dir: Path, steps: pd.DataFrame, events: pd.DataFrame) -> str:
    judged = len(events_of(events, "anomaly")) + len(events_of(events, "hang"))
    if judged:
        return f"{judged} anomalies and hangs judged"
    try:
        targets = json.loads((run_dir / "targets.json").read_text())
    except (OSError, ValueError):
        return ""
    jobs = (
        {t.get("labels", {}).get("job") for t in targets if isinstance(t, dict)}
        if isinstance(targets, list)
        else set()
    )
    return "live detection ran beside the job" if DETECTOR_JOB in jobs else ""


def _adaptive(run_dir: Path, steps: pd.DataFrame, events: pd.DataFrame) -> str:
    applied = events_of(events, "suggestion_applied")
    applied = (
        applied[[d.get("status", "applied") == "applied" for d in applied["detail"]]]
        if len(applied)
        else applied
    )
    measured = events_of(events, "outcome")
    if len(applied) and len(measured):
        return f"{len(applied)} change(s) applied in flight, {len(measured)} outcome(s) measured"
    return ""
