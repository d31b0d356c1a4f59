"""The straggler rule: a rank that computes slower than its peers (much slower now), than its
usual pace against them (a little, step after step), or than its own pace in a phase while
its peers kept theirs (several at once, when the job's median is the slow half)."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from meshscope.collector.env import HostShare
from meshscope.detectors.domain import PersistentStraggler, Straggler
from meshscope.detectors.modes import MIX_ROWS
from meshscope.detectors.phases import PHASES, PhasePace
from meshscope.detectors.rules import Flag, StepRule, Verdict

# flagged steps before a straggler found against its own pace is told: a shared host's
# bursts move a rank's pace for a few steps
PHASE_CONFIRM = 8


class StragglerRule(StepRule):
    """A rank computes slower than its peers: much slower now (`Straggler`), or a little
    slower than its usual pace, step after step (`PersistentStraggler`, three ranks or more);
    several at once; or slower than its own pace in a phase while others kept theirs
    (`PhasePace`: up to all ranks but one, on a shared host too)."""

    name, during_warmup = "straggler", False
    timed_only = True
    types = ("straggler",)

    def __init__(
        self,
        ratio: float,
        on_score: Any,
        persistent: list[PersistentStraggler],
        pace: PhasePace | None = None,
    ) -> None:
        """`persistent`: one detector per horizon (a few steps on a quiet cluster; longer
        ones see through the bursts of a shared host); `pace`: each rank against its own pace."""
        self.detector = Straggler(ratio=ratio)
        self.base_ratio = ratio
        self.persistent = persistent
        self.subtle = True  # the persistent detectors judge (not on an oversubscribed host)
        self.on_score = on_score
        self.span_rows = max(p.span for p in persistent)  # what the horizons read
        # the recent steps' compute relative to the other ranks, one row per step (the mix of
        # modes is read over MIX_ROWS of them)
        self.recent: collections.deque[np.ndarray] = collections.deque(maxlen=max(self.span_rows, MIX_ROWS))
        self.pace = pace or PhasePace()
        self.recent_phases: collections.deque[dict[str, np.ndarray]]
        self.recent_phases = collections.deque(maxlen=self.pace.span)
        self.recent_steps: collections.deque[float] = collections.deque(maxlen=self.pace.span)
        self.mixed: set[int] = set()  # rank indices whose changed mix of modes is being told

    def judge_against(self, host: HostShare) -> None:
        """Ranks taking turns on too few cores differ in pace by up to the oversubscription:
        a straggler must stand out by that much more, and a subtle, persistent one cannot be
        told from the host's sharing at all."""
        self.detector.set_params(ratio=self.base_ratio * max(1.0, host.factor))
        self.subtle = not host.oversubscribed

    def learn(self, warm: Any) -> None:
        self.detector.fit(warm.compute)
        for p in self.persistent:
            p.fit(warm.compute)
        self.recent.clear()
        self.pace.fit(warm.phases)
        self.recent_phases.clear()
        self.recent_steps.clear()

    def judge(self, step: int, row: Any, verdict: Verdict) -> list[Flag]:
        ratio = -float(self.detector.score_samples(row.compute)[0])
        self.on_score("straggler", ratio)
        self.recent.append(self.persistent[0].relative(row.compute)[0])  # paces alike: one data
        self.recent_phases.append({p: x[0] for p, x in row.phases.items()})
        self.recent_steps.append(float(row.value("step_s")))
        slow = self.detector.culprits(row.compute)[0]
        if slow:
            return [
                Flag(
                    "straggler",
                    ratio,
                    ranks=[row.ranks[i] for i in slow],
                    confirm=3,
                    evidence=self._evidence(row, ratio=round(ratio, 2)),
                    line=self.detector.line(slow),
                    cost=_time_lost(row.compute[0], slow),
                )
            ]
        return self._persistent(row) or self._phases(row)

    def _phases(self, row: Any) -> list[Flag]:
        """Ranks slower than their own pace in a phase, while others kept theirs."""
        # two ranks: as for the persistent rule, a majority of peers to tell "slower" from noise
        if len(row.ranks) < 3 or not self.pace.ready or len(self.recent_phases) < self.pace.span:
            return []
        recent = {p: np.vstack([r[p] for r in self.recent_phases]) for p in PHASES}
        slow = self.pace.slow(recent, float(np.median(self.recent_steps)))
        if not slow:
            return []
        return [
            Flag(
                "straggler",
                1 + excess,
                ranks=[row.ranks[i]],
                confirm=PHASE_CONFIRM,
                gap=self.pace.span,
                cost=_time_lost(row.compute[0], [i]),
                evidence=self._evidence(
                    row,
                    ratio=round(1 + excess, 3),
                    phase=phase,
                    usual_s=round(float(self.pace.usual[phase][i]), 4),
                    over_steps=self.pace.span,
                    own_pace=True,
                ),
            )
            for i, (phase, excess) in sorted(slow.items())
        ]

    def _persistent(self, row: Any) -> list[Flag]:
        # With two ranks "one is slow" and "the other is fast" look the same: a subtle
        # straggler needs a majority of peers to be measured against.
        if len(row.ranks) < 3 or not self.subtle:
            return []
        recent = np.vstack(list(self.recent)[-self.span_rows :])
        shortest = min(self.persistent, key=lambda p: p.span)
        if len(recent) < shortest.span:
            return []
        excesses = {p.span: p.latest_excess(recent) for p in self.persistent if len(recent) >= p.span}
        # still slow lately (over the shortest horizon) and now: a straggle that ended is over
        lately = np.minimum(excesses[shortest.span], shortest.latest_excess(recent[-1:]))
        slow: dict[int, tuple[float, int]] = {}  # rank index -> (excess, horizon)
        for p in self.persistent:
            thresholds = p.thresholds()
            if p.span not in excesses or not np.isfinite(thresholds).any():
                continue
            excess = excesses[p.span]
            for i in np.flatnonzero((excess > thresholds) & (lately > shortest.min_excess)):
                if i not in slow or excess[i] > slow[i][0]:
                    slow[int(i)] = (float(excess[i]), p.span)
        mixed = self._mix_changed(slow)
        if not slow or len(slow) > len(row.ranks) // 2:
            return []  # more than half slower than the median is not how a median works
        # One episode per rank, with a wider gap: several stragglers do not come and go as a
        # group, and a noisy step or two below the line does not close a persistent straggle.
        return [
            Flag(
                "straggler",
                1 + excess,
                ranks=[row.ranks[i]],
                gap=2 * shortest.span,
                cost=_time_lost(row.compute[0], [i]),
                evidence=self._evidence(
                    row,
                    ratio=round(1 + excess, 3),
                    persistent=True,
                    over_steps=horizon,
                    usual_pace=round(float(shortest.pace_[i]), 3),
                    **mixed.get(i, {}),
                ),
            )
            for i, (excess, horizon) in sorted(slow.items())
        ]

    def _mix_changed(self, slow: dict[int, tuple[float, int]]) -> dict[int, dict]:
        """Ranks with two known modes whose mix changed over their last `MIX_ROWS` steps
        (`PersistentStraggler.mix_excess`) join `slow`; their evidence says the shares. Only
        their columns are read: at thousands of ranks most have one mode."""
        longest = max(self.persistent, key=lambda p: p.span)
        ranks = longest.two_modes()
        if len(self.recent) < MIX_ROWS or not len(ranks) or not np.isfinite(longest.thresholds()).any():
            self.mixed = set()
            return {}
        rows = np.array([row[ranks] for row in self.recent])
        excess = longest.mix_excess(rows, ranks, np.isin(ranks, list(self.mixed)))
        self.mixed = {int(ranks[j]) for j in np.flatnonzero(excess > longest.min_excess)}
        mixed = {}
        for j in np.flatnonzero(excess > longest.min_excess):  # NaN: no change of mix
            i = int(ranks[j])
            mixed[i] = {
                "slow_mode_share": round(float(longest.in_slower_mode(rows[:, j], i).mean()), 2),
                "usual_slow_mode_share": round(float(longest.slow_share_[i]), 2),
            }
            if i not in slow or excess[j] > slow[i][0]:
                slow[i] = (float(excess[j]), longest.span)
        return mixed

    @staticmethod
    def _evidence(row: Any, **extra: Any) -> dict[str, Any]:
        return {"compute_s": {str(r): round(float(v), 4) for r, v in zip(row.ranks, row.compute[0])}, **extra}

    def update(self, row: Any, normal: bool) -> None:
        if normal:
            self.detector.partial_fit(row.compute)
            for p in self.persistent:
                p.partial_fit(row.compute)
            self.pace.partial_fit(row.phases)


def _time_lost(compute: np.ndarray, slow: list[int]) -> float:
    """What the slowest of `slow` held its peers this step: its compute beyond theirs."""
    others = np.delete(compute, slow)
    if not len(others):
        return float("inf")
    return max(0.0, float(np.max(compute[slow]) - np.median(others)))
