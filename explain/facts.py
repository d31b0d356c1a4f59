"""What root cause reads about a run, loaded once: steps, events, expert load and anomaly
episodes (stored, or replayed through the detectors), and the window a hypothesis looks at."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from meshscope.collector.env import HostShare
from meshscope.collector.report import busiest_host
from meshscope.collector.rundir import run_info
from meshscope.collector.store import load_events, load_expert_load, load_expert_work, load_steps
from meshscope.detectors.engine import DetectionEngine
from meshscope.detectors.pauses import known_pauses

# What each cause means, for people and for the view's legend.
CAUSE_KINDS = {
    "hang": "a rank stopped or diverged; its peers waited in a collective",
    "slow_host": "one rank's own compute is slow (host or device); its peers wait for it",
    "slow_link": "communication slowed on every rank while compute did not: the link",
    "nonfinite": "a NaN/Inf appeared; the first module that produced it",
    "routing": "the router sends most tokens to few experts",
    "leak": "one rank's memory grows step after step",
    "crash": "a rank's process died",
    "recovery_failing": "restarts keep failing at the same place",
    "checkpoint": "meshscope saved a checkpoint: every rank waited for it (expected, not a fault)",
    "host_oversubscribed": "more busy threads than cores: ranks take turns, none is slow",
    "hot_experts": "expert parallelism: the experts placed on one rank get more tokens; it computes "
    "longer and its peers wait in the all-to-all",
}


SLOW_RATIO = 1.5  # compute this many times its peers' makes a straggler


LINK_RISE = 3.0  # exposed communication this many times its usual on every rank


HOT_WORK = 1.3  # a rank's experts processing this many times the mean tokens of every rank's
HOT_RISE = 1.2  # ... and this many times their own share before the anomaly (what changed)


LEAK_MIN_BYTES = 16 * 2**20


BASELINE_STEPS = 30


@dataclass
class Cause:
    """One probable cause: what, who, how sure, why we think so, and what to do next."""

    kind: str
    title: str
    confidence: float
    ranks: list[int]
    step: int | None
    evidence: list[str]
    action: str
    anomaly_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.confidence = round(float(self.confidence), 3)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (the view and `meshscope explain --json`)."""
        return asdict(self)


@dataclass
class Anomaly:
    """An anomaly episode as the store holds it (or as a replay of the detectors found it)."""

    id: int | None
    type: str
    ranks: list[int]
    start_step: int
    end_step: int
    score: float = 0.0
    layer: int | None = None
    expert: int | None = None
    module: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    severity: str = "warning"

    @classmethod
    def from_event(cls, row: Any) -> Anomaly:
        """From a row of `load_events(run, "anomaly")`."""
        d = row["detail"]
        return cls(
            int(row["id"]),
            d.get("type", "?"),
            list(d.get("ranks") or []),
            int(d.get("start_step", row["step"] if row["step"] is not None else 0)),
            int(d.get("end_step", d.get("start_step", 0))),
            float(d.get("score", 0.0)),
            d.get("layer"),
            d.get("expert"),
            d.get("module"),
            d.get("evidence") or {},
            row["severity"],
        )


class UnknownAnomaly(KeyError):
    """An anomaly id the run does not hold: the user's input, told apart from a KeyError that
    is a bug (that one must surface as itself)."""


@dataclass
class RunFacts:
    """Everything explain reads about one run, loaded once."""

    run_dir: Path
    steps: pd.DataFrame
    events: pd.DataFrame
    experts: pd.DataFrame
    anomalies: list[Anomaly]
    expert_work: pd.DataFrame = field(default_factory=pd.DataFrame)  # per rank (expert parallelism)

    @classmethod
    def load(cls, run_dir: str | Path) -> RunFacts:
        """Read the store; when no detector judged the run live, replay the detectors."""
        run_dir = Path(run_dir)
        steps, events, experts = load_steps(run_dir), load_events(run_dir), load_expert_load(run_dir)
        stored = events[events["kind"] == "anomaly"]
        if len(stored):
            anomalies = [Anomaly.from_event(row) for _, row in stored.iterrows()]
        else:
            anomalies = replay_anomalies(run_dir, steps, experts, busiest_host(events), known_pauses(events))
        return cls(run_dir, steps, events, experts, anomalies, load_expert_work(run_dir))

    def anomaly(self, anomaly_id: int) -> Anomaly:
        """The stored anomaly with this event id; KeyError naming the ids there are."""
        for a in self.anomalies:
            if a.id == anomaly_id:
                return a
        ids = [a.id for a in self.anomalies if a.id is not None]
        hint = "" if ids else f"; `meshscope detect --run {self.run_dir}` stores them"
        known = f"anomaly ids: {ids or 'none'}{hint}"
        raise UnknownAnomaly(f"no anomaly {anomaly_id} in {self.run_dir} ({known})")


def replay_anomalies(
    run_dir: Path,
    steps: pd.DataFrame,
    experts: pd.DataFrame,
    host: HostShare | None = None,
    pauses: set[int] | None = None,
) -> list[Anomaly]:
    """The detectors' episodes over a recorded run (ids are None: they are not in the store),
    judged against the host its ranks shared and apart from meshscope's own pauses, as live."""
    if steps.empty:
        return []
    found: list[Anomaly] = []
    engine = DetectionEngine(
        top_k=run_info(run_dir).top_k,
        on_close=lambda ep: found.append(
            Anomaly(
                None,
                ep.type,
                list(ep.ranks),
                ep.start_step,
                ep.end_step,
                ep.score,
                ep.layer,
                ep.expert,
                ep.module,
                ep.evidence,
            )
        ),
    )
    if host is not None:
        engine.judge_against(host)
    engine.pause(pauses or set())
    engine.process(steps, experts)
    engine.finish()
    return found


@dataclass
class Window:
    """The steps a hypothesis looks at, and the quiet steps before them it compares with."""

    lo: int
    hi: int

    def of(self, df: pd.DataFrame) -> pd.DataFrame:
        """The rows inside the window."""
        return df[(df["step"] >= self.lo) & (df["step"] <= self.hi)]

    def before(self, df: pd.DataFrame) -> pd.DataFrame:
        """The quiet rows just before the window (the baseline)."""
        return df[(df["step"] < self.lo) & (df["step"] >= self.lo - BASELINE_STEPS)]


def _pivot(df: pd.DataFrame, column: str) -> pd.DataFrame:
    return df.pivot_table(index="step", columns="rank", values=column, aggfunc="last")


def _span(lo: int, hi: int) -> str:
    return f"step {lo}" if lo == hi else f"steps {lo}–{hi}"


def _who(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _top_k(facts: RunFacts, every: int) -> int:
    """Experts per token: the run's config, else the counts (a layer's window holds k x the
    tokens its steps processed)."""
    known = run_info(facts.run_dir).top_k
    if known is not None:
        return known
    per_step = facts.steps.groupby("step")["tokens"].sum().median() if not facts.steps.empty else 0
    routed = facts.experts.groupby(["step", "layer"])["tokens"].sum().median()
    experts = facts.experts["expert"].nunique()
    if not per_step or not routed:
        return 1
    return int(min(experts, max(1, round(routed / (per_step * every)))))


def _step_time_rise(facts: RunFacts, w: Window) -> float:
    win, base = w.of(facts.steps), w.before(facts.steps)
    if win.empty or base.empty:
        return 1.0
    return float(
        win.groupby("step")["step_s"].max().median()
        / max(base.groupby("step")["step_s"].max().median(), 1e-9)
    )
