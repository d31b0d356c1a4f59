"""The detection engine: StepRecords in, anomaly episodes out, beside training or afterwards.

It holds its detectors as rules (`detectors.rules`): step rules judge complete steps in order
(the first `warmup` steps fit them; a NaN is judged from the first step), window rules judge
the expert-load and gradient tables as they arrive. Flagged steps feed episodes, and normal
ones move the baselines on. Each episode
becomes one `anomaly` event (detail: type, ranks, layer/expert, score, start_step, end_step,
evidence) when it closes, and counts in `meshscope_anomalies_total{type}` when it opens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from meshscope.collector.env import HostShare
from meshscope.collector.figures import SLOW_STEP_FACTOR, STALL_FLOOR_S
from meshscope.detectors.domain import PersistentStraggler
from meshscope.detectors.episodes import Episode, EpisodeTracker
from meshscope.detectors.features import COLUMN, DetailCarry, StepFeaturizer, StepView, step_views
from meshscope.detectors.phases import PhasePace
from meshscope.detectors.rules import (
    MULTIVARIATE,
    CommRule,
    Flag,
    LossSpikeRule,
    MemoryRule,
    MultivariateRule,
    NonFiniteRule,
    StallRule,
    StepRule,
    Verdict,
    WindowRule,
)
from meshscope.detectors.stragglers import StragglerRule
from meshscope.detectors.thresholds import EngineConfig
from meshscope.detectors.window_rules import ExpertRule, GradientRule

# the clock of episodes judged on timed steps only: steps, but a flag every N of them
TIMED_CLOCK = "timed steps"
MIN_TIMED_WARMUP = 10  # timed rows a rule that reads phases learns from, however sparse they are


@dataclass
class _Row:
    """One step (or the stacked warm-up) as the detectors take it: 2-D arrays, a row per step."""

    feats: np.ndarray
    compute: np.ndarray
    loss: np.ndarray
    rss: np.ndarray
    device_mem: np.ndarray  # allocated device memory per rank (0 on the CPU)
    ranks: list[int]
    loss_bad: np.ndarray | None = None  # 1 where a logged loss was NaN/Inf (not: unlogged)
    grad_bad: np.ndarray | None = None  # likewise, a logged gradient norm
    grad_norm: np.ndarray | None = None
    busy: np.ndarray | None = None  # per rank: the step less its wait for communication
    phases: dict[str, np.ndarray] = field(default_factory=dict)  # `stragglers.PHASES`, per rank
    timed: bool = True  # phases measured this step (else each rank's last timed ones stand in)

    def col(self, name: str) -> np.ndarray:
        return self.feats[:, [COLUMN[name]]]

    def value(self, name: str) -> float:
        return float(self.feats[0, COLUMN[name]])

    @property
    def multivariate(self) -> np.ndarray:
        return self.feats[:, [COLUMN[n] for n in MULTIVARIATE]]


class DetectionEngine:
    """Holds the rules (`detectors.rules`) and asks them in order; see the module doc."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        on_open: Callable[[Episode], None] = lambda ep: None,
        on_close: Callable[[Episode], None] = lambda ep: None,
        on_score: Callable[[str, float], None] = lambda name, score: None,
        top_k: int | None = None,
    ) -> None:
        """`top_k`: experts each token is routed to, for the expert judgement (None: read
        from the counts, which hold top-k x the tokens)."""
        self.config = config or EngineConfig()
        s = self.config.sensitivity
        self.on_open, self.on_close, self.on_score = on_open, on_close, on_score
        # In order: a later rule may read what earlier ones said about the step (Verdict).
        self.rules: list[StepRule] = [
            NonFiniteRule(),
            StallRule(SLOW_STEP_FACTOR / s, STALL_FLOOR_S),  # 10x the usual, 1 s more: a stuck collective
            StragglerRule(
                ratio=1 + (self.config.thresholds.straggler_ratio - 1) / s,
                on_score=self._score,
                persistent=[
                    PersistentStraggler(min_excess=0.08 / s, z=4.0 / s, span=span) for span in (5, 20)
                ],
                pace=PhasePace(min_excess=0.10 / s, z=4.0 / s),
            ),
            CommRule(threshold=4.0 / s, slowdown=1 + 0.3 / s),  # ...and the step that much slower
            LossSpikeRule(threshold=8.0 / s),
            MemoryRule(mb_per_step=2.0 / s),
            MultivariateRule(on_score=self._score),
        ]
        self.window_rules: list[WindowRule] = [
            ExpertRule(self.config.warmup, top_k=top_k, hog_min=self.config.thresholds.expert_hotness),
            GradientRule(),
        ]
        self.tracker = EpisodeTracker(gap=self.config.gap)
        self.last_step = -1
        self._fitted: set[int] = set()  # ids of the rules that learnt their baselines
        self.featurizer = StepFeaturizer()
        self.carry = DetailCarry()
        self._last_timed: int | None = None
        self._period = 1  # steps between timed steps (`monitor.detail_every`), as seen
        self._warm: list[_Row] = []
        self._ranks: list[int] = []
        self.paused: set[int] = set()  # steps meshscope itself slowed (see `pause`)

    def _score(self, name: str, score: float) -> None:
        self.on_score(name, score)

    def pause(self, steps: set[int]) -> None:
        """Steps meshscope itself slowed (`detectors.pauses.known_pauses`: a checkpoint, a
        resume, an expert move): the job-wide rules neither judge them (a stall there is
        meshscope's, not a fault) nor learn from them; per-rank rules (a straggler, a NaN) still
        judge them, so a fault inside a checkpoint's steps is still seen."""
        self.paused |= set(steps)

    def judge_against(self, host: HostShare) -> None:
        """The host the ranks share: on an oversubscribed one, stragglers are judged against it."""
        self._straggler().judge_against(host)

    def _straggler(self) -> StragglerRule:
        return next(r for r in self.rules if isinstance(r, StragglerRule))

    @property
    def anomaly_types(self) -> tuple[str, ...]:
        """Every anomaly type this engine's rules can raise, in rule order."""
        return tuple(dict.fromkeys(t for rule in [*self.rules, *self.window_rules] for t in rule.types))

    @property
    def last_expert_step(self) -> int:
        """The last expert-load window judged."""
        return self._window("expert_load").last_step

    @property
    def last_grad_step(self) -> int:
        """The last gradient-statistics window judged."""
        return self._window("grad_stats").last_step

    def _window(self, table: str) -> WindowRule:
        return next(r for r in self.window_rules if r.table == table)

    # --- feeding --------------------------------------------------------------------------
    def process(
        self,
        steps: pd.DataFrame,
        expert_load: pd.DataFrame | None = None,
        grad_stats: pd.DataFrame | None = None,
    ) -> None:
        """Judge the steps after the last one seen (only steps every rank has recorded), then
        the windowed tables."""
        for view in step_views(steps, after=self.last_step):
            self._step(view)
            self.last_step = view.step
        if not steps.empty and "tokens" in steps:
            per_step = steps.groupby("step")["tokens"].sum()
            if (per_step > 0).any():
                self._window("expert_load").tokens_per_step = float(per_step[per_step > 0].median())
        tables = {"expert_load": expert_load, "grad_stats": grad_stats}
        for rule in self.window_rules:
            frame = tables.get(rule.table)
            if frame is not None and not frame.empty:
                for step, flag in rule.judge(frame):
                    self._flag(step, flag)
        self._close_quiet(self.last_step)

    def _close_quiet(self, step: int) -> None:
        """Close the episodes gone quiet, each by its own clock (the steps', or its table's)."""
        clocks = {"steps": step, TIMED_CLOCK: step, **{r.table: r.last_step for r in self.window_rules}}
        for ep in self.tracker.close_quiet(clocks):
            self.on_close(ep)

    def finish(self) -> list[Episode]:
        """Close every open episode (end of the run), after the verdicts rules still hold."""
        for rule in self.rules:
            for flag in rule.flush():
                self._flag(self.last_step, flag)
        done = self.tracker.close_all()
        for ep in done:
            self.on_close(ep)
        return done

    # --- one step -------------------------------------------------------------------------
    def _step(self, view: StepView) -> None:
        timed = self.carry.fill(view)
        if timed:
            if self._last_timed is not None:
                self._period = max(1, view.step - self._last_timed)
            self._last_timed = view.step
        row = _Row(
            self.featurizer.row(view).reshape(1, -1),
            view.compute_s.reshape(1, -1),
            view.cols["loss"].reshape(1, -1),
            view.cols["mem_rss"].reshape(1, -1),
            view.cols["mem_allocated"].reshape(1, -1),
            np.asarray(view.ranks, dtype=np.int64).tolist(),  # Python ints, one C call
            view.cols["loss_bad"].reshape(1, -1),
            view.cols["grad_bad"].reshape(1, -1),
            view.cols["grad_norm"].reshape(1, -1),
            # what each rank spent busy names a stall's holders: not known on an untimed step
            (view.cols["step_s"] - view.cols["comm_exposed_s"]).reshape(1, -1) if timed else None,
            {"forward": view.cols["forward_s"].reshape(1, -1), "compute": view.compute_s.reshape(1, -1)},
            timed,
        )
        if row.ranks != self._ranks:  # elastic shrink or grow: per-rank baselines start over
            self._ranks, self._fitted, self._warm = row.ranks, set(), []
        just_fitted = self._warm_up(row)
        paused = view.step in self.paused
        fitted = [r for r in self.rules if id(r) in self._fitted and (timed or not r.timed_only)]
        judged = [r for r in fitted if id(r) not in just_fitted and not (paused and r.job_wide)]
        judged += [r for r in self.rules if r.during_warmup and id(r) not in self._fitted]
        normal = self._judge(view.step, row, judged)
        for rule in fitted:
            if id(rule) not in just_fitted:
                rule.update(row, normal and not (paused and rule.job_wide))
        self._close_quiet(view.step)

    def _warm_up(self, row: _Row) -> set[int]:
        """Keep `row` until the rules have learnt (`warmup` rows; rules that read phases, the
        timed rows among as many steps, `MIN_TIMED_WARMUP` at least); the ids of the rules that
        learnt on it."""
        if len(self._fitted) == len(self.rules):
            return set()
        self._warm.append(row)
        timed = [w for w in self._warm if w.timed]
        fitted: set[int] = set()
        # rules that read phases learn from as many steps as the others, not as many timed
        # rows: one step in 10 timed would make a user's loop wait 200 steps for its first
        # straggler verdict (a few timed rows at least)
        timed_warmup = max(MIN_TIMED_WARMUP, -(-self.config.warmup // self._period))
        for rows, timed_only, needed in (
            (self._warm, False, self.config.warmup),
            (timed, True, timed_warmup),
        ):
            due = [r for r in self.rules if r.timed_only == timed_only and id(r) not in self._fitted]
            if due and len(rows) >= needed:
                warm = _stacked(rows, self._ranks)
                for rule in due:
                    rule.learn(warm)
                fitted |= {id(r) for r in due}
        self._fitted |= fitted
        if len(self._fitted) == len(self.rules):
            self._warm = []
        return fitted

    def _judge(self, step: int, row: _Row, rules: list[StepRule]) -> bool:
        """Ask the rules in order; returns whether the step was normal."""
        verdict = Verdict()
        for rule in rules:
            flags = rule.judge(step, row, verdict)
            if rule.timed_only and self._period > 1:
                flags = [self._sparse(f) for f in flags]
            verdict.flags += flags
            if any(f.final for f in flags):
                break
        for flag in verdict.flags:
            self._flag(step, flag)
        return verdict.normal

    def _sparse(self, flag: Flag) -> Flag:
        """A flag of a rule that judges timed steps only, when one step in N is timed: its
        episode stays open across the untimed steps between (a gap of as many timed steps)."""
        gap = (flag.gap or self.tracker.gap) * self._period
        return replace(flag, gap=gap, clock=TIMED_CLOCK)

    def _flag(self, step: int, flag: Flag) -> None:
        """Feed the episode tracker; a new episode is announced at once."""
        opened = self.tracker.flag(
            step if flag.about is None else flag.about,
            flag.type,
            flag.score,
            ranks=flag.ranks,
            layer=flag.layer,
            expert=flag.expert,
            module=flag.module,
            evidence=flag.evidence,
            gap=flag.gap,
            confirm=flag.confirm,
            clock=flag.clock,
            now=step,
            line=flag.line,
            cost=flag.cost,
            facet=flag.facet,
        )
        if opened is not None:
            self.on_open(opened)


def _stacked(rows: list[_Row], ranks: list[int]) -> _Row:
    """Warm-up rows as one: a row per step."""
    return _Row(
        *(
            np.vstack([getattr(w, f) for w in rows])
            for f in ("feats", "compute", "loss", "rss", "device_mem")
        ),  # noqa: E501
        ranks,
        phases={p: np.vstack([w.phases[p] for w in rows]) for p in rows[0].phases},
    )
