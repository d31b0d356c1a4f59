"""A slow rank as root cause sees it: a rank whose own compute is slower than its peers' while
they wait for it in communication, or ranks slower than their own pace while the others kept
theirs (several at once: the job's median can be the slow half); where the time went (the
phase that grew on it); or a host too shared for any rank to be called slow."""

from __future__ import annotations

import pandas as pd

from meshscope.collector.env import HostShare
from meshscope.collector.figures import with_compute
from meshscope.collector.report import busiest_host
from meshscope.detectors.phases import ADDED_SHARE, SPAN
from meshscope.explain.facts import SLOW_RATIO, Cause, RunFacts, Window, _pivot, _span, _who


def slow_host(facts: RunFacts, w: Window) -> list[Cause]:
    """A rank whose own compute is slower than its peers' while they wait in communication."""
    steps = with_compute(w.of(facts.steps))
    if steps.empty or steps["rank"].nunique() < 2:
        return []
    compute = _pivot(steps, "compute_s")
    med = compute.median()
    best = med.idxmax()
    others = med.drop(best)
    ratio = float(med[best] / max(float(others.median()), 1e-9))
    paced = _slower_than_own_pace(facts, w, steps, med)
    if ratio < SLOW_RATIO or (paced and len(paced[0].ranks) > 1):
        return paced
    host = busiest_host(facts.events)
    if host is not None and host.oversubscribed and ratio < SLOW_RATIO * host.factor:
        return paced or [_oversubscribed(host, ratio, w)]
    if med[best] - others.median() < ADDED_SHARE * float(steps["step_s"].median()):
        return paced  # slower by a sliver of the step: what its peers waited for was not it
    rank = int(best)
    phase, times = _grown_phase(facts, w, rank, steps)
    waited = float(_pivot(steps, "comm_exposed_s").drop(columns=best).median().median())
    return [
        Cause(
            "slow_host",
            f"rank {rank} computes {ratio:.1f}× slower than its peers",
            min(0.92, 0.55 + 0.1 * ratio),
            [rank],
            w.lo,
            [
                f"rank {rank}'s compute {med[best]:.3f} s per step vs its peers' {others.median():.3f} s "
                f"over {_span(w.lo, w.hi)} (mostly in {phase}, {times:.1f}× {_phase_reference(facts, w)})",
                f"its peers waited {waited:.3f} s per step in communication for it",
            ],
            f"check rank {rank}'s host and device: other processes, clocks and thermal throttling "
            "(nvidia-smi -q -d PERFORMANCE / npu-smi info), its data-loader workers; if it stays "
            "slow, cordon the node and let the job shrink around it",
        )
    ]


PHASES = ("forward_s", "backward_s", "optimizer_s", "data_s")
OWN_PACE = 1.15  # compute this many times its own before the window, while others kept theirs


def _slower_than_own_pace(facts: RunFacts, w: Window, steps: pd.DataFrame, now: pd.Series) -> list[Cause]:
    """Ranks whose compute grew past their own pace before the window while the other ranks
    kept theirs (and waited for them): a shared host slows every rank, a straggler not."""
    # the pace before the straggle: the detector judges spans of SPAN steps, so the straggle
    # may have begun that long before the episode's first step
    earlier = Window(w.lo - SPAN, w.hi)
    base = with_compute(earlier.before(facts.steps))
    if base.empty or base["rank"].nunique() != now.size or "forward_s" not in base:
        return []  # no pace to compare with (or a store from before phases were timed)
    before = _pivot(base, "compute_s").median().reindex(now.index)
    pace, grew = now / before.clip(lower=1e-9), now - before
    # forward holds no wait for peers: a rank whose compute grew only in backward may have
    # waited there for the slow ones (DDP's reduction overlaps backward)
    forward = _pivot(steps, "forward_s").median() / _pivot(base, "forward_s").median().clip(lower=1e-9)
    slow = pace[(pace >= OWN_PACE) & (forward.reindex(pace.index) >= OWN_PACE)].index
    kept = pace.drop(slow)
    if slow.empty or kept.empty or kept.median() - 1 >= 0.5 * (pace[slow].min() - 1):
        return []  # nobody, everybody (the job slowed), or the others strayed as far
    step_s = float(steps["step_s"].median())
    slow = [r for r in slow if grew[r] - grew[kept.index].median() >= ADDED_SHARE * step_s]
    if not slow:
        return []
    ranks = sorted(int(r) for r in slow)
    waited = float(_pivot(steps, "comm_exposed_s")[kept.index].median().median())
    evidence = [
        f"rank {r}'s compute {now[r]:.3f} s per step vs its own {before[r]:.3f} s before step "
        f"{earlier.lo} ({pace[r]:.2f}×; mostly in {phase}, {times:.1f}× its own before)"
        for r in ranks
        for phase, times in [_grown_phase(facts, earlier, r, steps)]
    ]
    kept_ranks = sorted(int(r) for r in kept.index)
    evidence.append(
        f"{_who(kept_ranks)} kept {'its' if len(kept_ranks) == 1 else 'their'} pace "
        f"({', '.join(f'{pace[r]:.2f}×' for r in kept_ranks)}) and "
        f"waited {waited:.3f} s per step in communication for {_who(ranks)}"
    )
    return [
        Cause(
            "slow_host",
            f"{_who(ranks)} compute{'s' if len(ranks) == 1 else ''} {pace[slow].min():.2f}×"
            f"{'' if len(ranks) == 1 else f'–{pace[slow].max():.2f}×'} "
            f"{'its' if len(ranks) == 1 else 'their'} own pace while {_who(kept_ranks)} "
            f"kept {'its own' if len(kept_ranks) == 1 else 'theirs'}",
            min(0.85, 0.5 + 0.5 * (float(pace[slow].min()) - 1)),
            ranks,
            w.lo,
            evidence,
            f"check the hosts and devices of {_who(ranks)}: other processes, clocks and thermal "
            "throttling (nvidia-smi -q -d PERFORMANCE / npu-smi info), their data-loader workers; "
            "ranks slowed together often share a node, a switch or a power domain",
        )
    ]


def _grown_phase(facts: RunFacts, w: Window, rank: int, steps: pd.DataFrame) -> tuple[str, float]:
    """Where the slow rank's time went: the phase that grew most on it since before the window
    (its peers' phases grow too: under DDP they wait in backward), as (phase, times its usual);
    without steps before the window, the phase furthest above its peers'."""
    mine = steps[steps["rank"] == rank]
    base = w.before(facts.steps)
    base = base[base["rank"] == rank]
    if not base.empty:
        grew = {p: float(mine[p].median() - base[p].median()) for p in PHASES if p in mine}
        phase = max(grew, key=grew.get)
        return phase.removesuffix("_s"), float(mine[phase].median() / max(base[phase].median(), 1e-9))
    peers = steps[steps["rank"] != rank]
    ratio = {p: float(mine[p].median() / max(peers[p].median(), 1e-9)) for p in PHASES if p in mine}
    phase = max(ratio, key=ratio.get)
    return phase.removesuffix("_s"), ratio[phase]


def _phase_reference(facts: RunFacts, w: Window) -> str:
    return "its own before" if not w.before(facts.steps).empty else "its peers'"


def _oversubscribed(host: HostShare, ratio: float, w: Window) -> Cause:
    """Ranks unequal only as far as sharing too few cores makes them: the host, not a rank."""
    return Cause(
        "host_oversubscribed",
        f"the host is oversubscribed ({host.factor:.1f} busy threads per core): no rank is slow",
        0.7,
        [],
        w.lo,
        [
            f"{host.ranks} rank(s) x {host.threads} thread(s) share {host.cores} core(s)",
            f"the slowest rank computes {ratio:.1f}x its peers over {_span(w.lo, w.hi)}, within what "
            f"taking turns on the cores explains (up to {SLOW_RATIO * host.factor:.1f}x)",
        ],
        "run fewer ranks per node (--nproc), fewer threads per rank (OMP_NUM_THREADS), or on more cores",
    )
