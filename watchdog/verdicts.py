"""The watchdog's verdicts, named once, and the `Diagnosis` a `hang` event carries."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from meshscope.collector.schema import HangDetail


class Verdict(str, Enum):
    """What kind of hang it is; the value is the `type` of the hang event's detail."""

    MISMATCH = "mismatch"  # ranks issued the same collective with a different op/shape/dtype/splits
    DESYNC = "desync"  # a rank skipped a collective and pairs with the wrong partner since
    ERROR = "error"  # a rank raised while its peers waited
    DEAD = "dead"  # a rank vanished without a clean exit
    MISSING = "missing"  # ranks never entered the collective the others wait in
    COMPUTE = "compute"  # ...and their stacks show them computing (or nobody is in a collective)
    STUCK = "stuck"  # everyone entered it and it does not complete: transport or device
    REMOTE = "remote"  # the ranks behind are another node's, not seen here
    UNDETERMINED = "undetermined"  # ranks wait on each other and nothing says who began it
    NONE = "none"  # a post-mortem whose collectives all completed and matched: no hang there


@dataclass
class Diagnosis:
    """What the watchdog concluded: the `hang` event's detail."""

    kind: Verdict
    culprit_ranks: list[int]
    waiting_ranks: list[int]
    why: str
    op: str | None = None
    seq: int | None = None
    group: str | None = None
    stacks: dict[int, list[str]] = field(default_factory=dict)
    evidence: dict[str, Any] = field(default_factory=dict)
    step: int | None = None  # the step the fault is in: the `hang` event's own step
    detected_at: float | None = None  # when the judging watchdog concluded (its clock)
    pids: dict[str, int] = field(default_factory=dict)  # rank -> pid of this node's ranks (abort)

    def __post_init__(self) -> None:
        self.kind = Verdict(self.kind)

    @classmethod
    def from_detail(cls, detail: dict[str, Any]) -> Diagnosis:
        """A diagnosis as another node's watchdog posted it (`detail()` read back)."""
        named = ("type", "culprit_ranks", "waiting_ranks", "op", "seq", "group", "why", "stacks")
        typed = ("step", "detected_at", "pids")
        return cls(
            Verdict(detail["type"]),
            list(detail["culprit_ranks"]),
            list(detail["waiting_ranks"]),
            detail["why"],
            detail.get("op"),
            detail.get("seq"),
            detail.get("group"),
            {int(r): s for r, s in (detail.get("stacks") or {}).items()},
            {k: v for k, v in detail.items() if k not in named + typed},
            step=detail.get("step"),
            detected_at=detail.get("detected_at"),
            pids=dict(detail.get("pids") or {}),
        )

    def detail(self) -> HangDetail:
        """The `hang` event's detail (JSON-ready)."""
        return {
            "type": self.kind.value,
            "culprit_ranks": self.culprit_ranks,
            "waiting_ranks": self.waiting_ranks,
            "op": self.op,
            "seq": self.seq,
            "group": self.group,
            "why": self.why,
            "stacks": {str(r): s for r, s in self.stacks.items()},
            **self.evidence,
            **{k: v for k, v in (("step", self.step), ("detected_at", self.detected_at)) if v is not None},
            **({"pids": self.pids} if self.pids else {}),
        }
