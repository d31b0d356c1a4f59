"""Root cause's answer: every hypothesis over an anomaly's window (or over the whole run), one
cause per kind and ranks, most confident first. The most specific explanation wins: a
concurrent routing collapse explains slower communication better than a slow link does, and a
hang the watchdog diagnosed outranks any reading of step times.

Pure reading: the store is opened read-only, nothing is written."""

from __future__ import annotations

from pathlib import Path

from meshscope.explain.facts import Anomaly, Cause, RunFacts, Window
from meshscope.explain.hypotheses import HYPOTHESES, _crash, _hang_events, _nonfinite

MIN_CONFIDENCE = 0.5  # below it a reading is a guess: shown nowhere, not as a trailing cause
# What can move an expert's share of the tokens: the router, the load it gives a rank's
# experts, or a non-finite value that reached the router first. Any other cause in the window
# is another fault at the same time, not this anomaly's explanation.
EXPERT_CAUSES = {"routing", "hot_experts"}
UNRELATED = 0.5  # what a cause that cannot explain the anomaly keeps of its confidence


def _rank_causes(causes: list[Cause]) -> list[Cause]:
    """One cause per (kind, ranks), most confident first; a routing collapse in the same
    window explains slower communication better than a slow link does."""
    if any(c.kind == "routing" for c in causes):
        for c in causes:
            if c.kind == "slow_link":
                c.confidence = round(c.confidence * 0.6, 3)
                c.evidence.append("the routing changed at the same time (see routing)")
    hot = {tuple(c.ranks) for c in causes if c.kind == "hot_experts"}
    for c in causes:  # more tokens for the rank's experts explain its compute and its memory
        if c.kind == "slow_host" and tuple(c.ranks) in hot:
            c.confidence = round(c.confidence * 0.6, 3)
            c.evidence.append("its experts received more tokens than its peers' (see hot_experts)")
        if c.kind == "leak" and tuple(c.ranks) in hot:
            c.confidence = round(c.confidence * 0.6, 3)
            c.evidence.append(
                "its experts received more tokens (see hot_experts): activations grow with them"
            )
    # meshscope's own pause explains as much of the window as its share of the extra time: a
    # rank slow outside the checkpoint's steps is still slow
    share = max((c.confidence / 0.9 for c in causes if c.kind == "checkpoint"), default=0.0)
    if share >= 0.05:
        for c in causes:
            if c.kind in ("slow_host", "slow_link", "stall", "host_oversubscribed"):
                c.confidence = round(c.confidence * (1 - share), 3)
                c.evidence.append(f"a checkpoint accounts for {share:.0%} of the window's extra time")
    merged: dict[tuple, Cause] = {}
    for c in causes:
        key = (c.kind, tuple(c.ranks))
        if key in merged:
            kept = merged[key]
            kept.anomaly_ids = sorted(set(kept.anomaly_ids) | set(c.anomaly_ids))
            if c.confidence > kept.confidence:
                c.anomaly_ids = kept.anomaly_ids
                merged[key] = c
        else:
            merged[key] = c
    kept = [c for c in merged.values() if c.confidence >= MIN_CONFIDENCE]
    return sorted(kept, key=lambda c: (-c.confidence, c.step if c.step is not None else 1 << 62))


def causes_for(facts: RunFacts, anomaly: Anomaly) -> list[Cause]:
    """The ranked causes of one anomaly: every hypothesis over its window."""
    w = Window(anomaly.start_step, anomaly.end_step)
    causes = [c for h in HYPOTHESES for c in h(facts, w)]
    for c in causes:
        c.anomaly_ids = [anomaly.id] if anomaly.id is not None else []
        if anomaly.type == "expert_imbalance" and not _moves_expert_load(c, w):
            c.confidence = round(c.confidence * UNRELATED, 3)
            c.evidence.append("another fault in the same window: it moves no expert's share of tokens")
    return _rank_causes(causes)


def _moves_expert_load(cause: Cause, w: Window) -> bool:
    """Can `cause` explain an expert's load changing in `w` (EXPERT_CAUSES)?"""
    if cause.kind in EXPERT_CAUSES:
        return True
    return cause.kind == "nonfinite" and cause.step is not None and cause.step <= w.lo


def explain(run: str | Path | RunFacts, anomaly_id: int | None = None) -> list[Cause]:
    """Probable causes, most confident first: of one stored anomaly, or of the whole run (its
    anomalies' windows plus what events say on their own: hangs, NaNs, deaths)."""
    facts = run if isinstance(run, RunFacts) else RunFacts.load(run)
    if anomaly_id is not None:
        return causes_for(facts, facts.anomaly(anomaly_id))
    causes = [c for a in facts.anomalies for c in causes_for(facts, a)]
    if not facts.steps.empty:
        whole = Window(int(facts.steps["step"].min()), int(facts.steps["step"].max()))
        causes += [c for h in (_hang_events, _nonfinite, _crash) for c in h(facts, whole)]
    return _rank_causes(causes)
