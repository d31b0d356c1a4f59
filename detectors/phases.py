"""Stragglers found in the phases, against each rank's own pace.

When several ranks slow at once, their peers absorb the wait inside a collective: step times
stay equal, the slow ranks' forward (or compute) grows, the others' exposed communication
grows, and the job's median can be the slow half. A peer-relative rule then sees nothing.
`PhasePace` judges each rank against its own usual time in each phase instead: a rank is slow
in a phase when the lower quartile of its last `span` steps (slow on nearly every step, not
on some: a second mode or a burst is not a straggler) exceeds its usual time there by more
than its own noise allows, while other ranks kept their pace (a slow step for everyone is not a
straggler). A rank named from a phase must also compute more than the other ranks did, by
a share of a step: a rank whose forward grew while everyone's did (a host that got busier)
is not named.
"""

from __future__ import annotations

import numpy as np

from meshscope.detectors.base import RingRows
from meshscope.detectors.domain import robust_noise, span_quartile, span_stats

# the phases judged: `forward` holds no wait for peers (without expert parallelism), `compute`
# is the whole step less the exposed wait for communication and data
PHASES = ("forward", "compute")
ADDED_SHARE = 0.05  # a straggler's compute grew by this share of a step more than its peers'
SPAN = 12  # steps a rank's pace in a phase is judged over: a straggle starts up to this many
# steps before the episode that tells it


class PhasePace:
    """Per phase, per rank: the usual time (median of the normal past) and how far the lower quartile
    of `span` steps strays from it in normal times (`z` robust deviations, `margin` times the
    largest stray seen, at least `min_excess`)."""

    def __init__(
        self,
        span: int = SPAN,
        min_excess: float = 0.10,
        z: float = 4.0,
        margin: float = 1.5,
        floor: float = ADDED_SHARE,
        window: int = 100,
        relearn_every: int = 10,
    ) -> None:
        self.span, self.min_excess, self.z, self.margin = span, min_excess, z, margin
        self.floor = floor  # the added time must be this share of a step at least
        self.window, self.relearn_every = window, relearn_every
        self.history: dict[str, RingRows] = {}
        self.usual: dict[str, np.ndarray] = {}
        self.lines: dict[str, np.ndarray] = {}
        self._unlearnt = 0

    def fit(self, phases: dict[str, np.ndarray]) -> PhasePace:
        """Learn from normal rows (one per step, one column per rank) of each phase."""
        self.history = {p: RingRows(self.window, x.shape[1]).extend(x) for p, x in phases.items()}
        self._learn()
        return self

    def partial_fit(self, phases: dict[str, np.ndarray]) -> None:
        """One more normal row per phase; relearnt every `relearn_every` rows."""
        for p, x in phases.items():
            self.history[p].extend(x)
        self._unlearnt += 1
        if self._unlearnt >= self.relearn_every:
            self._learn()

    def _learn(self) -> None:
        for p, ring in self.history.items():
            rows = ring.last(len(ring)).T  # oldest first: the span medians need the order
            usual = np.median(rows, axis=0)
            rel = rows / np.maximum(usual, 1e-12)
            if len(rel) >= self.span:  # whole spans only
                rel = span_stats(rel, self.span)[self.span - 1 :]
            strays = rel - 1
            noise = robust_noise(strays)
            self.usual[p] = usual
            self.lines[p] = np.maximum.reduce(
                [np.full_like(usual, self.min_excess), self.z * noise, self.margin * strays.max(axis=0)]
            )
        self._unlearnt = 0

    @property
    def ready(self) -> bool:
        """Enough normal past to tell a rank's noise from a change of pace."""
        return bool(self.history) and min(len(r) for r in self.history.values()) >= 2 * self.span

    def slow(self, recent: dict[str, np.ndarray], step_s: float) -> dict[int, tuple[str, float]]:
        """Rank index -> (phase, excess) for each rank slower than its own pace over the
        `recent` rows (the last `span` steps, oldest first) while other ranks kept theirs."""
        excess = {p: self._excess(p, x) for p, x in recent.items()}
        out: dict[int, tuple[str, float]] = {}
        for p, (over, short) in excess.items():
            usual = self.usual[p]
            if not (usual > 0).all():
                continue  # a phase this store does not time (an older one, a user's loop)
            # slow over the span and still slow over the last steps: a straggle that ended is over
            lines = self.lines[p]
            slow = (over > lines) & (short > lines) & (over * usual > self.floor * step_s)
            if not slow.any() or slow.all() or np.median(over[~slow]) >= 0.5 * over[slow].min():
                continue  # none, everyone (the job slowed), or the others strayed as far
            for i in np.flatnonzero(slow):
                if int(i) not in out or over[i] > out[int(i)][1]:
                    out[int(i)] = (p, float(over[i]))
        return self._computing_more(out, excess["compute"][0] * self.usual["compute"], step_s)

    def _computing_more(
        self, named: dict[int, tuple[str, float]], added_s: np.ndarray, step_s: float
    ) -> dict[int, tuple[str, float]]:
        """Of `named`, the ranks whose compute grew by `floor` of a step more than the other
        ranks' did: a host that got busier for everyone slows every rank's phases, and one
        rank's noisier forward is then no straggler."""
        others = np.delete(added_s, list(named))
        if not len(others):
            return {}  # every rank slower than its pace: the job slowed, nobody waited
        level = float(np.median(others))
        return {i: v for i, v in named.items() if added_s[i] - level >= self.floor * step_s}

    def _excess(self, phase: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the `SPAN_Q` percentile of the span, the least of the last 3) over the usual
        time, minus 1: slow on (nearly) every step, not on some (a second mode, a burst)."""
        rel = rows / np.maximum(self.usual[phase], 1e-12)
        return span_quartile(rel[-self.span :]) - 1, rel[-3:].min(axis=0) - 1
