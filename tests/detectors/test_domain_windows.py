"""The per-column window statistics the straggler detectors run at every step: equal to numpy's."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from meshscope.detectors.base import RingRows, percentile_by_column


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 30),
    q=st.floats(0, 100),
    seed=st.integers(0, 2**16),
)
def test_percentile_by_column_is_numpys(rows, cols, q, seed):
    X = np.random.default_rng(seed).standard_normal((cols, rows))
    assert np.allclose(percentile_by_column(X, q), np.percentile(X, q, axis=1))


@settings(max_examples=40, deadline=None)
@given(size=st.integers(1, 12), total=st.integers(1, 40), k=st.integers(1, 12))
def test_a_ring_holds_the_last_rows_in_order(size, total, k):
    rows = np.arange(total * 3, dtype=float).reshape(total, 3)
    ring = RingRows(size, 3)
    for row in rows:
        ring.extend(row[None])
    kept = rows[-size:]
    assert len(ring) == len(kept)
    assert np.array_equal(np.sort(ring.by_column(), axis=1), kept.T)  # every kept row, no other
    assert np.array_equal(ring.last(k), kept[-k:].T)  # the newest, oldest first
