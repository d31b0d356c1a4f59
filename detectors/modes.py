"""A worker's step-time modes: some jobs' workers alternate between a fast and a slower step,
which is their normal, and what moves is the mix of the two (`detectors.domain.
PersistentStraggler` takes a step in a known mode as usual, and a changed mix as news)."""

from __future__ import annotations

import numpy as np

MODE_GAP, MODE_SHARE, MODE_SPREAD, MODE_WIDTH = 0.2, 0.05, 0.08, 0.1
"""A rank has two known modes when its normal steps split in two groups `MODE_GAP` apart
(relative to the faster), each tight (their median deviation within `MODE_SPREAD` of their
centre), the slower holding at least `MODE_SHARE` of them and the faster at least a fifth: a
worker that alternates between two step times, not a host's scattered bursts (which make no
tight group). A step within `MODE_WIDTH` (or three of the mode's deviations) below the slower
mode's centre is in that mode."""


MIX_ROWS, MIX_SHIFT, MIX_ALPHA, MIX_LEARN = 60, 0.3, 1e-6, 0.1
"""A rank with two known modes changed its mix when, over its last `MIX_ROWS` steps, the share in
its slower mode rose `MIX_SHIFT` or more above the share its normal past held, and steps drawn
at the usual share would give that many with a probability below `MIX_ALPHA` (a binomial tail:
a false call in about a million rank-steps of a quiet job). Its mean pace then moved, though
every step it takes is one of its known modes. The usual share moves `MIX_LEARN` of the way to
what each relearn sees."""


def paces_and_modes(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per rank (columns of `rows`, its relative compute over normal steps): its usual pace
    (the faster mode when it has two, else the median), its slower mode over that pace (inf
    where it has none), how far below that mode a step is still in it (`MODE_WIDTH`, or
    three of the mode's own deviations if wider) and the share of its steps in the slower mode
    (NaN where it has none). A 1-D two-means, all ranks at once."""
    # Each column sorted once: a rank's two groups are the two runs of its sorted steps on
    # either side of the split, so each group's median is an order statistic (a masked median
    # per group and iteration took seconds a relearn at 16,384 ranks)
    ordered = np.sort(rows, axis=0)
    valid = (~np.isnan(rows)).sum(axis=0)
    low, high = np.percentile(rows, 10, axis=0), np.percentile(rows, 90, axis=0)
    for _ in range(8):
        split_by = (low, high)
        split = valid - (np.abs(ordered - high) < np.abs(ordered - low)).sum(axis=0)
        low, high = _median_between(ordered, 0, split, low), _median_between(ordered, split, valid, high)
    upper = np.abs(rows - split_by[1]) < np.abs(rows - split_by[0])
    share = upper.mean(axis=0)
    spread_low = _masked_median(np.abs(rows - low), ~upper, np.inf) / np.maximum(low, 1e-12)
    spread_high = _masked_median(np.abs(rows - high), upper, np.inf) / np.maximum(high, 1e-12)
    two = (
        (high >= low * (1 + MODE_GAP))
        & (share >= MODE_SHARE)
        & (share <= 0.8)
        & (np.maximum(spread_low, spread_high) <= MODE_SPREAD)
    )
    pace = np.where(two, low, np.median(rows, axis=0))
    width = np.where(two, np.maximum(MODE_WIDTH, 3 * spread_high), MODE_WIDTH)
    return pace, np.where(two, high / np.maximum(low, 1e-12), np.inf), width, np.where(two, share, np.nan)


def _median_between(
    ordered: np.ndarray, start: np.ndarray, stop: np.ndarray, empty: np.ndarray
) -> np.ndarray:
    """Per column of sorted `ordered`: the median of rows start..stop-1, `empty` where none."""
    count, last = stop - start, len(ordered) - 1
    below = np.take_along_axis(ordered, np.clip(start + (count - 1) // 2, 0, last)[None], axis=0)[0]
    above = np.take_along_axis(ordered, np.clip(start + count // 2, 0, last)[None], axis=0)[0]
    return np.where(count > 0, (below + above) / 2, empty)


def _masked_median(rows: np.ndarray, mask: np.ndarray, empty: np.ndarray | float) -> np.ndarray:
    """Per column: the median of `rows` where `mask` (and a number), `empty` where there is none.
    One sort of the columns (NaN sorts last), exact as `np.nanmedian` and ten times faster at
    thousands of ranks: a relearn every few steps took seconds at 16,384."""
    mask = mask & ~np.isnan(rows)
    ordered = np.sort(np.where(mask, rows, np.nan), axis=0)
    count = mask.sum(axis=0)
    low = np.take_along_axis(ordered, (np.maximum(count - 1, 0) // 2)[None], axis=0)[0]
    high = np.take_along_axis(ordered, (count // 2)[None], axis=0)[0]
    return np.where(count > 0, (low + high) / 2, empty)
