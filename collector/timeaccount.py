"""Where a job's time went: its wall time cut into goodput and named badput buckets, per rank and
for the job, from what the store already holds (steps, the steps a restart redid, events).

The buckets are named as Google's ML Productivity Goodput names its badput, and productive time
is split as meshscope measures a step:
- productive: `compute`, `gradient_comm` and `expert_comm` (communication the step waited for,
  by collective kind; the wait for a slower rank is not communication but `straggler`);
- badput: `startup` (worker start to first step, and model build after a restart),
  `checkpoint_save` (the time a save held training), `checkpoint_restore`, `data_loading`,
  `wasted_progress` (steps a restart redid), `restart` (failure to the new workers' start:
  detection and rendezvous), `hang` (stall to abort), `straggler` (the part of a rank's exposed
  communication spent waiting for the slowest rank's pace: busy time smoothed over a few
  steps, so jitter between balanced ranks is not counted), `idle`.

Each rank's timeline from the job's start (its first worker's start) to its end (the clean end,
else its last step) is cut into segments, each counted in exactly one bucket: steps, the gaps
between them (a checkpoint's hold, a stall), and the gaps between attempts, cut at the times the
next attempt's `resume` event gives. The buckets therefore add up to the wall time; the job's
figure is the mean over ranks. ETTR, productive over wall, is what Meta reports and what
Google's runtime goodput is.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from meshscope.collector.figures import fill_untimed

PRODUCTIVE = ("compute", "gradient_comm", "expert_comm")
BADPUT = (
    "startup",
    "checkpoint_save",
    "checkpoint_restore",
    "data_loading",
    "wasted_progress",
    "restart",
    "hang",
    "straggler",
    "idle",
)
BUCKETS = PRODUCTIVE + BADPUT
# one colour per bucket, everywhere it is drawn: goodput in greens and blues, badput warm
BUCKET_COLOURS = {
    "compute": "#2ca02c",
    "gradient_comm": "#1f77b4",
    "expert_comm": "#17becf",
    "startup": "#c7c7c7",
    "checkpoint_save": "#bcbd22",
    "checkpoint_restore": "#dbdb8d",
    "data_loading": "#9467bd",
    "wasted_progress": "#d62728",
    "restart": "#ff7f0e",
    "hang": "#8c564b",
    "straggler": "#e377c2",
    "idle": "#7f7f7f",
}


@dataclass
class TimeAccount:
    """Seconds per bucket for the job (mean over ranks) and for each rank; `wall_s` is the span
    they add up to."""

    wall_s: float
    job: dict[str, float]
    ranks: dict[int, dict[str, float]] = field(default_factory=dict)

    @property
    def productive_s(self) -> float:
        """Goodput seconds: compute and the communication steps waited for."""
        return sum(self.job[b] for b in PRODUCTIVE)

    @property
    def ettr(self) -> float:
        """Effective training time ratio: productive time over wall time."""
        return self.productive_s / self.wall_s if self.wall_s > 0 else math.nan

    def shares(self) -> dict[str, float]:
        """Each bucket's share of the wall time."""
        return {b: (s / self.wall_s if self.wall_s > 0 else math.nan) for b, s in self.job.items()}

    def text(self, top: int = 6) -> str:
        """ETTR and the largest buckets in one line (the summary, explain, the view)."""
        if self.wall_s <= 0:
            return "n/a (no steps)"
        shares = sorted(self.shares().items(), key=lambda kv: -kv[1])
        parts = ", ".join(f"{b} {s:.1%}" for b, s in shares[:top] if s >= 0.0005)
        head = f"ETTR {self.ettr:.1%} of {self.wall_s:.1f} s wall (productive {self.productive_s:.1f} s)"
        return f"{head}: {parts}" if parts else head


def account_bars(account: TimeAccount) -> pd.DataFrame:
    """(who, bucket, seconds) rows: the job's bar and one per rank, buckets in `BUCKETS` order
    (the view's stacked bars)."""
    rows = [("job", b, s) for b, s in account.job.items()]
    rows += [(f"rank {r}", b, s) for r, buckets in account.ranks.items() for b, s in buckets.items()]
    return pd.DataFrame(rows, columns=["who", "bucket", "seconds"])


def _empty() -> dict[str, float]:
    return dict.fromkeys(BUCKETS, 0.0)


def time_account(steps: pd.DataFrame, retried: pd.DataFrame, events: pd.DataFrame) -> TimeAccount:
    """The job's time account (module doc); an empty account when there are no steps."""
    if steps.empty:
        return TimeAccount(0.0, _empty())
    every = pd.concat([steps.assign(wasted=False), retried.assign(wasted=True)], ignore_index=True)
    # a store from before attempts were recorded: one attempt, cut where a worker (re)started
    every["attempt"] = every["attempt"].fillna(0) if "attempt" in every else 0
    every = fill_untimed(every)  # steps not timed in full: their rank's nearest timed shares
    every = every.sort_values(["time", "step"], kind="stable")
    start, end = _job_span(every, events)
    waits, marks = _straggler_waits(every), _Marks.read(events)
    ranks = {
        int(rank): _rank_account(rows, waits, marks, start, end)
        for rank, rows in every.groupby("rank", sort=True)
    }
    job = {b: sum(r[b] for r in ranks.values()) / len(ranks) for b in BUCKETS}
    return TimeAccount(end - start, job, ranks)


def _job_span(every: pd.DataFrame, events: pd.DataFrame) -> tuple[float, float]:
    """From the first worker's start (the run_start events say it) to the clean end, else the
    last step's end."""
    first = float(every["time"].min())
    last = float((every["time"] + every["step_s"]).max())
    started = [d.get("process_started_at") for d in events_of(events, "run_start")["detail"]]
    started = [float(t) for t in started if isinstance(t, (int, float)) and math.isfinite(t)]
    ends = events_of(events, "run_end")["time"]
    start = min([first, *started])
    end = max(last, float(ends.max())) if len(ends) else last
    return start, end


def events_of(events: pd.DataFrame, kind: str) -> pd.DataFrame:
    """The events of one kind (the frame itself when it is empty: it may have no columns)."""
    return events[events["kind"] == kind] if not events.empty else events


PACE_STEPS = 9  # a rank's pace: the median of its busy time over this many steps around each


def _straggler_waits(every: pd.DataFrame) -> pd.Series:
    """Per row: how long the rank waited for the slowest rank's pace in that step, at most its
    exposed communication. A pace is a rank's busy time (step less exposed communication)
    smoothed over `PACE_STEPS` steps, so the jitter between balanced ranks, which moves from
    rank to rank, is not a straggler, and a rank slower step after step is."""
    exposed = every["comm_exposed_s"].fillna(0.0).clip(lower=0.0)
    busy = (every["step_s"].fillna(0.0) - exposed).clip(lower=0.0)
    by_rank = busy.groupby([every["attempt"], every["wasted"], every["rank"]], sort=False)
    pace = by_rank.transform(lambda b: b.rolling(PACE_STEPS, center=True, min_periods=1).median())
    slowest = pace.groupby([every["attempt"], every["step"], every["wasted"]]).transform("max")
    return (slowest - pace).clip(lower=0.0).clip(upper=exposed)


@dataclass
class _Marks:
    """The events a timeline is cut at, read once: checkpoint holds by saved step, hang and
    abort times, the resume events' timings and the workers' start times, each by time."""

    held: dict[int, float]
    restarts: list[float]
    hangs: list[float]
    aborts: list[float]
    resumes: list[tuple[float, dict[str, Any]]]
    starts: list[float]

    @classmethod
    def read(cls, events: pd.DataFrame) -> _Marks:
        """From the run's events."""
        held: dict[int, float] = {}
        for d in events_of(events, "checkpoint")["detail"]:
            if isinstance(d.get("saved_step"), int):
                held[d["saved_step"]] = held.get(d["saved_step"], 0.0) + _seconds(d.get("held_s"))
        hangs = events_of(events, "hang")
        starts = [d.get("process_started_at") for d in events_of(events, "run_start")["detail"]]
        resumes = events_of(events, "resume")
        workers = events[events["kind"].isin(["run_start", "resume"])] if not events.empty else events
        return cls(
            held,
            sorted(map(float, workers["time"])),
            sorted(map(float, hangs["time"])),
            # when the watchdog decided to abort (its event may be written after the restart)
            sorted(
                _time(d.get("detected_at"), t)
                for t, d in zip(hangs["time"], hangs["detail"])
                if d.get("action") == "abort"
            ),
            sorted(zip(map(float, resumes["time"]), resumes["detail"]), key=lambda td: td[0]),
            sorted(float(t) for t in starts if isinstance(t, (int, float)) and math.isfinite(t)),
        )

    @staticmethod
    def within(times: list[float], a: float, b: float) -> list[float]:
        """The times in [a, b]."""
        return times[bisect.bisect_left(times, a) : bisect.bisect_right(times, b)]


def _rank_account(
    rows: pd.DataFrame, waits: pd.Series, marks: _Marks, start: float, end: float
) -> dict[str, float]:
    """One rank's timeline, segment by segment (module doc)."""
    out = _empty()
    cursor, previous = start, None
    for index, row in zip(rows.index, rows.to_dict("records")):
        begin = float(row["time"])
        if begin > cursor:
            _gap(out, cursor, begin, previous, row, marks)
        cursor = max(cursor, begin)
        length = max(0.0, begin + float(row["step_s"]) - cursor)
        _step(out, row, length, float(waits[index]))
        cursor += length
        previous = row
    if end > cursor:
        _gap(out, cursor, end, previous, None, marks)
    return out


def _step(out: dict[str, float], row: dict[str, Any], length: float, wait: float) -> None:
    """A step's time: all wasted when a restart redid it, else its measured parts; what the
    parts do not cover is compute."""
    if row["wasted"]:
        out["wasted_progress"] += length
        return
    exposed = _seconds(row["comm_exposed_s"])
    expert = min(_seconds(row.get("comm_a2a_s", 0.0)), exposed)
    wait = min(wait, exposed - expert)
    parts = {
        "data_loading": _seconds(row.get("data_s", 0.0)),
        "expert_comm": expert,
        "straggler": wait,
        "gradient_comm": exposed - expert - wait,
    }
    measured = sum(parts.values())
    scale = length / measured if measured > length else 1.0  # a step clipped by the one before it
    for bucket, seconds in parts.items():
        out[bucket] += seconds * scale
    out["compute"] += max(0.0, length - measured * scale)


def _time(value: Any, default: float) -> float:
    """A time from an event's detail, else `default` (the event's own time)."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else float(default)


def _seconds(value: Any) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return 0.0
    return value if math.isfinite(value) and value > 0 else 0.0


def _gap(out: dict[str, float], a: float, b: float, before: Any, after: Any, marks: _Marks) -> None:
    """Time between two steps (or the job's ends): cut at the times the events give."""
    restarted = marks.within(marks.restarts, a, b)  # a worker started in it: a new attempt
    if before is not None and after is not None and before["attempt"] == after["attempt"] and not restarted:
        # a pause inside one attempt: the hold of the checkpoint saved after the step before
        # it (a background save's event may come later), then, on the way to a step a restart
        # redid, lost progress; else a stall the watchdog saw, else idle
        save = min(marks.held.get(int(before["step"]), 0.0), b - a)
        out["checkpoint_save"] += save
        rest = "wasted_progress" if after["wasted"] else "hang" if marks.within(marks.hangs, a, b) else "idle"
        out[rest] += b - a - save
        return
    # the job's start, or a restart: the next attempt's resume event says where its time went
    cuts: list[tuple[Any, str]] = []
    aborts = marks.within(marks.aborts, a, b)
    if before is not None and aborts:
        cuts.append((aborts[0], "hang"))
    resume = next((d for t, d in marks.resumes if a <= t <= b), None)
    if resume is not None:
        cuts += [(resume.get("process_started_at"), "restart" if before is not None else "startup")]
        cuts += [(resume.get("group_ready_at"), "startup"), (resume.get("restored_at"), "checkpoint_restore")]
    elif before is not None:
        cuts += [(t, "restart") for t in marks.within(marks.starts, a, b)[:1]]
    cuts.append((b, "startup" if after is not None else "idle"))
    _cut(out, a, b, cuts)


def _cut(out: dict[str, float], a: float, b: float, cuts: list[tuple[Any, str]]) -> None:
    """Count [a, b] by its cut points: each (time, bucket) takes the time up to it."""
    cursor = a
    for t, bucket in cuts:
        if not isinstance(t, (int, float)) or not math.isfinite(t):
            continue
        t = min(max(float(t), cursor), b)
        out[bucket] += t - cursor
        cursor = t
    out["idle"] += b - cursor


class TimeAccountCollector:
    """`meshscope_time_seconds_total{bucket}`: the job's time account as Prometheus counters,
    read from the run's store (the job store when there is one: every node) when scraped, at
    most once per `every_s`, or per 20 times the last read's duration when that is longer.
    Registered by the one process that judges the job (`leader`), so a job with several nodes
    exports it once."""

    def __init__(self, run_dir: Any, leader: Any = None, every_s: float = 15.0) -> None:
        self.run_dir, self.leader, self.every_s = run_dir, leader, every_s
        self._next_read = -math.inf
        self._account: TimeAccount | None = None

    def collect(self) -> Any:
        """The counters, one per bucket (nothing before the first step, or off the leader)."""
        from prometheus_client.core import CounterMetricFamily

        if self.leader is not None and not self.leader.held():
            return
        account = self._current()
        if account is None or account.wall_s <= 0:
            return
        family = CounterMetricFamily(
            "meshscope_time_seconds",
            "Job wall time by goodput/badput bucket (mean over ranks)",
            labels=["bucket"],
        )
        for bucket in BUCKETS:
            family.add_metric([bucket], account.job[bucket])
        yield family

    def describe(self) -> list[Any]:
        """Nothing up front: registering must not read the store."""
        return []

    def _current(self) -> TimeAccount | None:
        from meshscope.collector.store import load_events, load_retried_steps, load_steps

        now = time.monotonic()
        if now < self._next_read:
            return self._account
        try:
            self._account = time_account(
                load_steps(self.run_dir), load_retried_steps(self.run_dir), load_events(self.run_dir)
            )
        except Exception:  # a store not there yet, or not answering: the last account stands
            pass
        # the whole run is read each time: a long run's account waits longer (at most ~5 % of
        # a core on it), so a scrape never costs the judge more as the run grows
        self._next_read = now + max(self.every_s, 20 * (time.monotonic() - now))
        return self._account
