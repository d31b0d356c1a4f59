"""Detectors as interchangeable rules: what the engine holds in a list and asks in order.

Two kinds, one small protocol each; every rule declares the anomaly `types` it can raise (the
exported `meshscope_anomalies_total{type}` label set comes from them):

- a **StepRule** judges one complete step (every rank recorded it): `learn(warm)` on the
  warm-up rows, `judge(step, row, verdict)` returns its flags (it may read what earlier rules
  said in `verdict`), `update(row, normal)` moves its baseline on;
- a **WindowRule** judges a table that arrives in windows (expert load, gradient statistics):
  `judge(frame)` returns (step, flag) pairs and learns as it goes;

A `Flag` becomes an episode in the engine (`detectors.episodes`), then an `anomaly` event.
Hangs in progress are not judged here: the watchdog (`meshscope.watchdog`) reads the present.
Adding a detector: a class here following one protocol with its `types`, an entry in the
engine's list (`DetectionEngine.rules` / `window_rules`), and a board panel if it exports a score."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from meshscope.detectors.domain import MemoryGrowth, NonFinite
from meshscope.detectors.isolation import OnlineIsolationForest
from meshscope.detectors.moving import RobustZ

# Relative features only: levels (tokens/s, step time) drift with the run and the machine. Not
# the gradient norm either: 3-4x spikes for a step or two are ordinary in LM training (4 in a
# 15,000-step clean run here) and a spike that matters shows as a loss spike or a NaN.
MULTIVARIATE = ["step_spread", "compute_spread", "comm_ratio", "loss_delta", "mem_slope"]


# The smallest change per feature that can matter (the forest's scale floor): 5 % spread or
# comm ratio, 0.05 in loss, 1 MiB/step of memory. A feature that sat still in the window would
# otherwise turn the first wiggle into a million IQRs.
MULTIVARIATE_MIN_SCALE = (0.05, 0.05, 0.05, 0.05, float(1 << 20))


@dataclass
class Flag:
    """One rule's finding on one step (or window)."""

    type: str
    score: float
    ranks: list[int] | None = None
    confirm: int = 1
    evidence: dict[str, Any] = field(default_factory=dict)
    layer: int | None = None
    expert: int | None = None
    module: str | None = None
    gap: int | None = None
    final: bool = False
    """The step is explained: later rules do not judge it (a stall)."""
    clock: str = "steps"
    """The table whose progress closes its episode: a window rule's own (its flags arrive as
    its table does, a window or more behind the steps when tailing a live run)."""
    about: int | None = None
    """The earlier step this flag is about, when a rule held its verdict on it (None: the step
    being judged); it is announced at the step being judged."""
    line: float | None = None
    """The score above which the rule flags, where it has one: a weak flag just before a fault
    is then told from the fault (`episodes.WEAK_LEAD`)."""
    cost: float | None = None
    """Seconds of the job's time this step lost to it, where the rule can say: an episode
    whose flags cost less than `episodes.MIN_COST_S` together is no anomaly."""
    facet: str | None = None
    """Which way the finding goes where one key can go two ways (an expert that hogs, then
    starves): each facet is an episode of its own, which ends when its flags do."""


@dataclass
class Verdict:
    """What the rules have said about one step so far."""

    flags: list[Flag] = field(default_factory=list)
    usual_step_s: float = float("nan")

    @property
    def normal(self) -> bool:
        """No rule has flagged the step so far (a held verdict on an earlier step is not about it)."""
        return not any(f.about is None for f in self.flags)

    def has(self, type: str) -> bool:
        """Whether a rule already flagged this type on the step."""
        return any(f.type == type for f in self.flags)


class StepRule:
    """Judges one complete step (see the module doc). Subclasses override `judge`, and
    `learn`/`update` when they keep a baseline."""

    name: str
    types: tuple[str, ...]  # the anomaly types its flags carry
    during_warmup: bool = False  # judges before the warm-up ends (a NaN needs no baseline)
    # judges the whole job's step time: a step meshscope itself paused (a checkpoint, a resume)
    # is not its to judge, nor to learn from (`DetectionEngine.pause`)
    job_wide: bool = False
    # reads phases or the wait for communication: learns from and judges the timed steps only
    # (a Monitor may time one step in N: `monitor.detail_every`)
    timed_only: bool = False

    def learn(self, warm: Any) -> None:
        """Fit on the warm-up rows (one row per step)."""

    def judge(self, step: int, row: Any, verdict: Verdict) -> list[Flag]:
        """This step's flags; `verdict` holds what earlier rules said."""
        raise NotImplementedError

    def update(self, row: Any, normal: bool) -> None:
        """Move the baseline on (most rules only on normal steps)."""

    def flush(self) -> list[Flag]:
        """Verdicts still held when the run ends (most rules hold none)."""
        return []


class WindowRule:
    """Judges a table of the run store as its windows arrive (see the module doc)."""

    name: str
    types: tuple[str, ...]  # the anomaly types its flags carry
    table: str  # which table of the run store it reads
    last_step: int = -1  # the last step judged

    def judge(self, frame: pd.DataFrame) -> list[tuple[int, Flag]]:
        """(step, flag) for the rows after the last judged step; learns as it goes."""
        raise NotImplementedError


class NonFiniteRule(StepRule):
    """A rank's logged loss or gradient norm is NaN or Inf."""

    name, during_warmup = "nan", True
    types = ("nan",)

    def __init__(self) -> None:
        self.detector = NonFinite()

    def learn(self, warm: Any) -> None:
        self.detector.fit(warm.loss)

    def judge(self, step: int, row: Any, verdict: Verdict) -> list[Flag]:
        # a loss that was never logged is absent, not NaN: only logged NaN/Inf count
        marked = row.loss if row.loss_bad is None else np.where(row.loss_bad > 0, np.nan, 0.0)
        bad = self.detector.culprits(marked)[0]
        grads = [] if row.grad_bad is None else list(np.flatnonzero(row.grad_bad[0] > 0))
        if not bad and not grads:
            return []  # the common case: no evidence written (thousands of ranks a step)
        evidence = {"loss": [str(v) for v in row.loss[0]]}
        if row.grad_norm is not None:
            evidence["grad_norm"] = [str(v) for v in row.grad_norm[0]]
        if bad:
            # every rank's own loss at once: a cause they share, or a NaN that crossed ranks
            # inside the forward (expert or tensor parallelism); naming all of them names none
            everyone = len(bad) == len(row.ranks) > 1
            if everyone:
                evidence["where"] = "forward: the loss of every rank"
            return [
                Flag("nan", 1.0, ranks=[] if everyone else [row.ranks[i] for i in bad], evidence=evidence)
            ]
        # every loss finite, a gradient norm not: a NaN born in backward. Every rank's norm is
        # NaN once the reduction spread it: that names no culprit (the tracer names the module)
        spread = len(grads) == len(row.ranks) > 1
        evidence["where"] = "backward: the gradient norm" + (
            " of every rank, after the reduction" if spread else ""
        )
        return [Flag("nan", 1.0, ranks=[] if spread else [row.ranks[i] for i in grads], evidence=evidence)]


class StallRule(StepRule):
    """A step many times the usual one: a stall (a stuck collective, a blocked input). Loud,
    so it explains the step (nothing else is judged). It owns the usual step time.

    A long step in which no rank was busy for long (every rank waited on communication) is
    held one step: alone it is a stall, announced at the next step; followed by another such
    step it is a slow link, a `comm` episode from the first (a stuck collective happens once,
    a slow link delays every step). A step a rank spent busy (a hang, a blocked input) is a
    stall at once. A stall adds `floor_s` at least: shorter blips (a TCP retransmit's 200 ms, a
    scheduler on a shared host, a GC pause) cost little and name no fault."""

    name, during_warmup = "stall", False
    job_wide = True
    types = ("stall", "comm")

    def __init__(self, factor: float, floor_s: float) -> None:
        self.factor, self.floor_s = factor, floor_s
        self.step_time = RobustZ(window=200)
        self.held: tuple[int, Flag] | None = None  # a long waiting step and its stall flag
        self.held_short = False  # ... shorter than a stall: a slow link's first step, or nothing
        self.waiting = False  # the last step was a long one spent waiting on the network

    def learn(self, warm: Any) -> None:
        self.step_time.fit(warm.col("step_s"))
        self.held, self.waiting = None, False

    def judge(self, step: int, row: Any, verdict: Verdict) -> list[Flag]:
        usual = float(self.step_time.center_[0])
        verdict.usual_step_s = usual
        step_s = row.value("step_s")
        held_step = self.held[0] if self.held else None
        before = self.flush()
        if step_s <= self.factor * usual:
            self.waiting = False
            return before  # a held step alone: a stall
        short = step_s - usual < self.floor_s
        if not self._waited(row, step_s):
            self.waiting = False
            return before + ([] if short else [self._stall(step_s, usual, self._busy_ranks(row, step_s))])
        if held_step is None and not self.waiting:
            self.held = (step, replace(self._stall(step_s, usual, row.ranks), confirm=2))
            self.held_short = short
            return [] if short else [self.held[1]]
        self.waiting = True  # a second long step waiting on the network: a slow link
        comm = Flag(
            "comm",
            step_s / usual,
            ranks=row.ranks,
            confirm=2,
            final=True,
            evidence={"comm_ratio": round(row.value("comm_ratio"), 4), "usual_step_s": round(usual, 4)},
        )
        return ([replace(comm, about=held_step, final=False)] if held_step is not None else []) + [comm]

    @staticmethod
    def _stall(step_s: float, usual: float, ranks: list[int]) -> Flag:
        evidence = {"stall_s": round(step_s, 3), "usual_step_s": round(usual, 4)}
        return Flag("stall", step_s / usual, ranks=ranks, final=True, evidence=evidence)

    @staticmethod
    def _busy_ranks(row: Any, step_s: float) -> list[int]:
        """The ranks that spent the stall busy while others waited on them in communication (a
        rank sleeping or stuck in its own code): the stall's ranks. All, when all were busy."""
        if row.busy is None:
            return row.ranks
        busy = np.asarray(row.busy).reshape(-1)
        hold = [r for r, b in zip(row.ranks, busy) if b >= 0.5 * step_s]
        waited = [r for r, b in zip(row.ranks, busy) if b < 0.25 * step_s]
        return hold if hold and waited else row.ranks

    @staticmethod
    def _waited(row: Any, step_s: float) -> bool:
        """No rank was busy (computing, or waiting for input) for half the step."""
        return row.busy is not None and float(np.max(row.busy)) < 0.5 * step_s

    def flush(self) -> list[Flag]:
        """The held step let go as a stall (at the next step, or at the end of the run)."""
        held, self.held = self.held, None
        return [replace(held[1], about=held[0], final=False)] if held and not self.held_short else []

    def update(self, row: Any, normal: bool) -> None:
        if normal:
            self.step_time.partial_fit(row.col("step_s"))


class CommRule(StepRule):
    """Communication's share of the step jumped and the step got slower: the network, not a
    rank (a straggler's peers wait in communication too, so a straggler step is not judged)."""

    name, during_warmup = "comm", False
    job_wide = timed_only = True
    types = ("comm",)

    def __init__(self, threshold: float, slowdown: float) -> None:
        self.detector = RobustZ(threshold=threshold)
        self.slowdown = slowdown

    def learn(self, warm: Any) -> None:
        self.detector.fit(warm.col("comm_ratio"))

    def judge(self, step: int, row: Any, verdict: Verdict) -> list[Flag]:
        if verdict.has("straggler"):
            return []
        comm = row.col("comm_ratio")
        if self.detector.predict(comm)[0] < 0 and row.value("step_s") > self.slowdown * verdict.usual_step_s:
            return [
                Flag(
                    "comm",
                    -float(self.detector.score_samples(comm)[0]),
                    ranks=row.ranks,
                    confirm=3,
                    evidence={"comm_ratio": round(row.value("comm_ratio"), 4)},
                )
            ]
        return []

    def update(self, row: Any, normal: bool) -> None:
        if normal:
            self.detector.partial_fit(row.col("comm_ratio"))


class LossSpikeRule(StepRule):
    """The loss jumped far beyond its usual step-to-step change."""

    name, during_warmup = "loss_spike", False
    types = ("loss_spike",)

    def __init__(self, threshold: float) -> None:
        self.detector = RobustZ(threshold=threshold)

    def learn(self, warm: Any) -> None:
        self.detector.fit(warm.col("loss_delta"))

    def judge(self, step: int, row: Any, verdict: Verdict) -> list[Flag]:
        delta = row.col("loss_delta")
        if np.isfinite(delta).all() and self.detector.predict(delta)[0] < 0:
            return [
                Flag(
                    "loss_spike",
                    -float(self.detector.score_samples(delta)[0]),
                    evidence={"loss_delta": round(row.value("loss_delta"), 4)},
                )
            ]
        return []

    def update(self, row: Any, normal: bool) -> None:
        if normal:
            self.detector.partial_fit(row.col("loss_delta"))


class MemoryRule(StepRule):
    """A rank's memory grows step after step (a leak), host memory (RSS) or device memory
    (allocated, from the device layer): each has its own baseline, which moves every step."""

    name, during_warmup = "memory", False
    types = ("memory",)
    SERIES = {"device": "device_mem", "host": "rss"}  # what each kind of memory is read from

    def __init__(self, mb_per_step: float) -> None:
        self.detectors = {kind: MemoryGrowth(mb_per_step=mb_per_step) for kind in self.SERIES}

    def learn(self, warm: Any) -> None:
        for kind, detector in self.detectors.items():
            detector.fit(getattr(warm, self.SERIES[kind]))

    def judge(self, step: int, row: Any, verdict: Verdict) -> list[Flag]:
        flags = []
        for kind, detector in self.detectors.items():  # device first: the scarcer memory
            series = getattr(row, self.SERIES[kind])
            leak = detector.culprits(series)[0]
            if leak:
                rate = float(detector.slopes(series)[0].max() * detector.mb_per_step)
                flags.append(
                    Flag(
                        "memory",
                        -float(detector.score_samples(series)[0]),
                        ranks=[row.ranks[i] for i in leak],
                        confirm=2,
                        evidence={"mb_per_step": round(rate, 2), "memory": kind},
                    )
                )
        return flags[:1]

    def update(self, row: Any, normal: bool) -> None:
        for kind, detector in self.detectors.items():
            detector.partial_fit(getattr(row, self.SERIES[kind]))


class MultivariateRule(StepRule):
    """IsolationForest over the relative features: what no single rule saw. Judged only on
    steps every other rule found normal, once it has enough rows to trust its scales."""

    name, during_warmup = "multivariate", False
    job_wide = timed_only = True
    types = ("multivariate",)

    def __init__(self, on_score: Any) -> None:
        self.forest = OnlineIsolationForest(min_scale=MULTIVARIATE_MIN_SCALE)
        self.on_score = on_score

    def learn(self, warm: Any) -> None:
        self.forest.fit(warm.multivariate)

    def judge(self, step: int, row: Any, verdict: Verdict) -> list[Flag]:
        score = float(self.forest.score_samples(row.multivariate)[0])
        self.on_score("isolation_forest", -score)
        trusted = len(self.forest.buffer_) >= 50  # too few rows make IQRs, and so alarms, noisy
        if verdict.normal and trusted and score < -self.forest.threshold:
            return [
                Flag(
                    "multivariate",
                    -score,
                    confirm=3,
                    evidence={"drivers": self.forest.explain(row.multivariate, MULTIVARIATE)[0]},
                )
            ]
        return []

    def update(self, row: Any, normal: bool) -> None:
        if normal:
            self.forest.partial_fit(row.multivariate)
