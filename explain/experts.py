"""Root cause under expert parallelism: the causal chain from a slow rank to the experts placed
on it. "Rank 3 is slow in layer 1 because experts 6 and 7, placed on it, receive 2.4× the mean
tokens" — told apart from a slow host (the same load, slower compute) by the load each rank's
experts processed (`expert_work`), and from the run's usual routing by what changed with the
anomaly."""

from __future__ import annotations

import numpy as np
import pandas as pd

from meshscope.collector.controls import placement_at
from meshscope.collector.figures import with_compute
from meshscope.collector.moe import experts_on
from meshscope.collector.rundir import RunInfo, run_info
from meshscope.explain.facts import HOT_RISE, HOT_WORK, SLOW_RATIO, Cause, RunFacts, Window, _span


def hot_experts(facts: RunFacts, w: Window) -> list[Cause]:
    """The rank whose experts processed most above every rank's mean in the window (and more
    than they usually do), with what it cost: its compute, its peers' wait in the all-to-all."""
    info = run_info(facts.run_dir)
    every = info.expert_every or 1
    found = _hottest(facts.expert_work, w, every)
    if found is None:
        return []
    layer, rank, ratio, per_rank = found
    held = _held(facts, info, layer, rank, w)
    named = f"expert{'s' if len(held) > 1 else ''} {_list(held)}" if held else "its experts"
    title = (
        f"{named}, placed on rank {rank}, receive{'' if len(held) > 1 else 's'} {ratio:.1f}× the mean tokens"
    )
    evidence = [
        f"rank {rank}'s experts processed {per_rank.loc[layer, rank] / every:.0f} tokens per step in layer "
        f"{layer}, {ratio:.1f}× the mean of every rank's ({per_rank.loc[layer].mean() / every:.0f}) over "
        f"{_span(w.lo, w.hi)}"
    ]
    demand = _expert_demand(facts.experts, layer, held, w, every)
    if demand is not None:
        evidence.append(f"the router sent {named} {demand:.1f}× an expert's mean share")
    slower, cost = _what_it_cost(facts, w, rank)
    evidence += cost
    title = (
        f"rank {rank} is slow in layer {layer} because {title}"
        if slower >= 1.1
        else f"{title} in layer {layer}"
    )
    return [
        Cause(
            "hot_experts",
            title,
            min(0.93, 0.5 + 0.15 * ratio + (0.1 if slower >= SLOW_RATIO else 0.0)),
            [rank],
            w.lo,
            evidence,
            "balance the router (a higher aux_loss_coef, or the aux-loss-free bias the feedback loop "
            f"tunes), or spread the load: {_spread(held)} (the view's Feedback page suggests a "
            "placement from these loads)",
        )
    ]


def _hottest(work: pd.DataFrame, w: Window, every: int) -> tuple[int, int, float, pd.DataFrame] | None:
    """(layer, rank, its work over every rank's mean, per-rank work) of the hottest rank whose
    share rose with the anomaly, or None under HOT_WORK."""
    if work.empty:
        return None
    win = work[(work["step"] >= w.lo) & (work["step"] <= w.hi + every - 1)]  # windows ending in it
    if win.empty:
        return None
    per_rank = win.groupby(["layer", "rank"])["tokens"].mean().unstack("rank")
    ratios = per_rank.div(per_rank.mean(axis=1), axis=0)
    # what changed with the anomaly: a share that was as high before is the run's usual routing
    base = w.before(work[work["step"] < w.lo])
    if not base.empty:
        before = base.groupby(["layer", "rank"])["tokens"].mean().unstack("rank")
        usual = before.div(before.mean(axis=1), axis=0).reindex_like(ratios)
        ratios = ratios.where((ratios / usual.clip(lower=1e-9)).fillna(np.inf) >= HOT_RISE, 0.0)
    layer, rank = ratios.stack().idxmax()
    ratio = float(ratios.loc[layer, rank])
    return None if ratio < HOT_WORK else (int(layer), int(rank), ratio, per_rank)


def _held(facts: RunFacts, info: RunInfo, layer: int, rank: int, w: Window) -> list[int]:
    """The experts `rank` held in `layer` during the window: the placement in force then."""
    if not info.experts:  # a run whose config does not say: the experts go unnamed
        return []
    placement, _ = placement_at(facts.run_dir, layer, info.experts, w.hi)
    return experts_on(placement, info.ep, rank)


def _what_it_cost(facts: RunFacts, w: Window, rank: int) -> tuple[float, list[str]]:
    """How many times its peers' compute the rank took, and the evidence of it."""
    steps = with_compute(w.of(facts.steps))
    if steps.empty or steps["rank"].nunique() < 2 or rank not in set(steps["rank"]):
        return 1.0, []
    compute = steps.groupby("rank")["compute_s"].median()
    slower = float(compute[rank] / max(float(compute.drop(rank).median()), 1e-9))
    said = f"rank {rank} computes {slower:.1f}× its peers"
    if "comm_a2a_s" in steps and steps["comm_a2a_s"].notna().any():
        waited = float(steps[steps["rank"] != rank]["comm_a2a_s"].median())
        said += f"; they waited {waited:.3f} s per step in the expert all-to-all"
    return slower, [said]


def _expert_demand(experts: pd.DataFrame, layer: int, held: list[int], w: Window, every: int) -> float | None:
    """How many times an expert's mean share of routed tokens the experts in `held` got."""
    if experts.empty or not held:
        return None
    rows = experts[(experts["layer"] == layer) & experts["step"].between(w.lo, w.hi + every - 1)]
    if rows.empty:
        return None
    load = rows.groupby("expert")["tokens"].sum()
    return float(load.reindex(held).fillna(0).mean() / max(float(load.mean()), 1e-9))


def _spread(held: list[int]) -> str:
    """What moves load off a rank that holds `held`."""
    if not held:
        return "place this rank's experts apart"
    if len(held) > 1:
        return f"place experts {_list(held)} on different ranks"
    return f"replicate expert {held[0]} on more ranks, or shard it"


def _list(items: list[int]) -> str:
    """1, 2 and 3."""
    names = [str(i) for i in items]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
