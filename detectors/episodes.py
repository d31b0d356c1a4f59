"""One ongoing anomaly is one episode: opened at its first flagged step, extended while flagged,
closed after `gap` quiet steps of its own clock (the steps, or the window table its rule reads:
expert load lands a window or more after the steps it sums, so the steps' clock would close an
ongoing collapse between two of its windows). Pure bookkeeping, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Episode:
    """A run of flagged steps of one kind and key: what becomes one anomaly."""

    type: str
    key: tuple
    start_step: int
    end_step: int
    score: float
    ranks: list[int] = field(default_factory=list)
    layer: int | None = None
    expert: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    gap: int = 3
    confirm: int = 1
    count: int = 1
    module: str | None = None
    clock: str = "steps"
    announced_step: int | None = None
    """The step that confirmed it: when it opened (alerts go out then), `confirm - 1` flagged
    steps after `start_step` or later."""
    run: list[tuple[int, float, dict[str, Any]]] = field(default_factory=list)
    """While pending: the unbroken run of flags it starts with, (step, excess over the rule's
    line, evidence), when the rule says where its line is."""
    cost: float | None = None
    """Seconds its flags cost the job together, where they say (`MIN_COST_S`)."""

    @property
    def confirmed(self) -> bool:
        """Flagged often enough, and costing enough, to be reported."""
        return self.count >= self.confirm and (self.cost is None or self.cost >= MIN_COST_S)

    def detail(self) -> dict[str, Any]:
        """The `anomaly` event's detail (`AnomalyDetail`)."""
        d = {
            "type": self.type,
            "ranks": self.ranks,
            "score": round(self.score, 4),
            "start_step": self.start_step,
            "end_step": self.end_step,
            "evidence": self.evidence,
        }
        if self.announced_step is not None:
            d["announced_step"] = self.announced_step
        if self.layer is not None:
            d["layer"] = self.layer
        if self.expert is not None:
            d["expert"] = self.expert
        if self.module is not None:
            d["module"] = self.module
        return d


class EpisodeTracker:
    """Turns per-step flags into episodes: opened when confirmed (`confirm` flags within `gap`
    of each other), starting at the latest unbroken run of flags; closed after `gap` quiet steps."""

    def __init__(self, gap: int = 3) -> None:
        self.gap = gap
        self.open: dict[tuple, Episode] = {}

    def flag(
        self,
        step: int,
        type: str,
        score: float,
        *,
        ranks: list[int] | None = None,
        layer: int | None = None,
        expert: int | None = None,
        module: str | None = None,
        evidence: dict[str, Any] | None = None,
        gap: int | None = None,
        confirm: int = 1,
        clock: str = "steps",
        now: int | None = None,
        line: float | None = None,
        cost: float | None = None,
        facet: str | None = None,
    ) -> Episode | None:
        """Record a flagged step; returns the episode when this step confirms it (after
        `confirm` flagged steps: one noisy step is not an anomaly). `now`: the step being
        judged, when the flag is about an earlier one (a held verdict); it announces. `line`:
        the score the rule flags above, which lets a weak flag just before a fault be told
        from the fault (`WEAK_LEAD`). `cost`: the seconds this step lost to it (`MIN_COST_S`).
        `facet`: which way it goes (hog or starve); each way is an episode of its own."""
        now = step if now is None else now
        key = (type, tuple(ranks or ()), layer, expert, module, facet)
        ep = self.open.get(key)
        if ep is None:
            ep = Episode(type, key, step, step, score, list(ranks or ()), layer, expert, dict(evidence or {}))
            ep.gap, ep.confirm, ep.module, ep.clock, ep.cost = gap or self.gap, confirm, module, clock, cost
            self.open[key] = ep
            self._note_run(ep, step, score, evidence, line)
            return self._announce(ep, now) if ep.confirmed else None
        was = ep.confirmed
        if cost is not None:
            ep.cost = (ep.cost or 0.0) + cost
        # only the steps' clock advances by one: a window table's next row is several steps on
        if not ep.confirmed and ep.clock == "steps" and step - ep.end_step > 1:
            # Pending, after a quiet step: the flags still count (a weak fault flags on and
            # off), but the start moves up, so a noisy step before a fault is not its start,
            # and its evidence and score are not the fault's.
            ep.start_step, ep.score, ep.evidence = step, score, dict(evidence or {})
            ep.run = []
        ep.end_step, ep.score, ep.count = max(ep.end_step, step), max(ep.score, score), ep.count + 1
        if evidence and "new_normal" in evidence:
            ep.evidence["new_normal"] = evidence["new_normal"]  # the level it settled at
        if not was:
            self._note_run(ep, step, score, evidence, line)
        return self._announce(ep, now) if ep.confirmed and not was else None

    @staticmethod
    def _note_run(ep: Episode, step: int, score: float, evidence: dict | None, line: float | None) -> None:
        """Keep a pending episode's leading run, and drop a weak lead from it."""
        if line is None or ep.clock != "steps":
            return
        ep.run.append((step, score - line, dict(evidence or {})))
        dropped = _weak_lead(ep.run)
        if dropped:
            ep.run = ep.run[dropped:]
            ep.count -= dropped  # the noise helped no confirmation: the fault confirms alone
            ep.start_step, ep.evidence = ep.run[0][0], ep.run[0][2]

    @staticmethod
    def _announce(ep: Episode, step: int) -> Episode:
        ep.announced_step = step
        return ep

    def close_quiet(self, clocks: dict[str, int] | int) -> list[Episode]:
        """Episodes with no flag for their `gap` steps of their clock (`clocks`: the latest
        step each clock has reached; an int is the steps' clock), removed and returned."""
        if isinstance(clocks, int):
            clocks = {"steps": clocks}
        done = [
            ep for ep in self.open.values() if ep.clock in clocks and clocks[ep.clock] - ep.end_step >= ep.gap
        ]
        for ep in done:
            del self.open[ep.key]
        return [ep for ep in done if ep.confirmed]

    def close_all(self) -> list[Episode]:
        """Close every open episode; the confirmed ones."""
        done, self.open = list(self.open.values()), {}
        return [ep for ep in done if ep.confirmed]


MIN_COST_S = 0.02
"""An episode whose flags say what they cost is reported once they cost the job this much
together: a one-step blip of a millisecond on a 2 ms step is no anomaly, while a rank 2×
slower on those steps is one within a few dozen steps."""

WEAK_LEAD = 0.5
"""A leading flag less than this share of its run's median excess over the line is noise that
happened to come just before a fault, not its start (a busy host's one slow step, then the
fault): dropped from the run, so the episode starts, and is confirmed, by the fault alone."""


def _weak_lead(run: list[tuple[int, float, dict[str, Any]]]) -> int:
    """How many leading flags of `run` are weak against the run (`WEAK_LEAD`)."""
    if len(run) < 2:
        return 0
    bar = WEAK_LEAD * float(sorted(excess for _, excess, _ in run)[len(run) // 2])
    dropped = 0
    while dropped < len(run) - 1 and run[dropped][1] < bar:
        dropped += 1
    return dropped
