"""The steps meshscope itself slowed, read from a run's events: the detectors judge them apart
(`DetectionEngine.pause`) and root cause counts their time as meshscope's, not a fault's.

A checkpoint saved after step s holds the job between s and s+1 (its staging) and runs on in
the background through s+1 (its writes and collectives); a resume's first steps load the
checkpoint and warm up (the first optimizer step, allocator growth); an approved change (an
expert move) lands at a step boundary."""

from __future__ import annotations

import pandas as pd

# event kind -> the steps after the event's step that it slows (0: its own)
PAUSES = {"checkpoint": (0, 1), "resume": (0, 1, 2), "suggestion_applied": (0, 1)}


def known_pauses(events: pd.DataFrame) -> set[int]:
    """Every step a checkpoint, a resume or an applied change slowed."""
    if events.empty or "kind" not in events:
        return set()
    out: set[int] = set()
    for kind, after in PAUSES.items():
        steps = events.loc[events["kind"] == kind, "step"].dropna()
        out |= {int(s) + d for s in steps for d in after}
    return out
