"""A worker's step-time modes (`detectors/modes.py`): two modes found where a worker alternates
and none where it does not, the share of its slower mode read right, and the medians behind
them exact (they are taken by one sort of each column, not `np.nanmedian`)."""

import warnings

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from meshscope.detectors.modes import _masked_median, paces_and_modes


def _reference_median(rows, mask, empty):
    """`np.nanmedian` over the masked values, `empty` where none: what the sort must equal."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = np.nanmedian(np.where(mask, rows, np.nan), axis=0)
    return np.where((mask & ~np.isnan(rows)).any(axis=0), out, empty)


@settings(max_examples=200, deadline=None)
@given(
    rows=arrays(
        float,
        st.tuples(st.integers(1, 30), st.integers(1, 6)),
        elements=st.one_of(st.floats(0.5, 2.0), st.sampled_from([1.0, 1.6, np.nan])),
    ),
    data=st.data(),
)
def test_the_masked_median_is_numpy_s(rows, data):
    mask = data.draw(arrays(bool, rows.shape))
    assert np.array_equal(_masked_median(rows, mask, np.inf), _reference_median(rows, mask, np.inf))


def test_two_modes_where_a_worker_alternates_and_none_where_it_does_not():
    rng = np.random.default_rng(0)
    slow = rng.random((100, 3)) < np.array([0.3, 0.5, 0.0])
    rows = (1 + 0.02 * rng.standard_normal((100, 3))) * np.where(slow, 1.6, 1.0)
    pace, upper, width, share = paces_and_modes(rows)
    assert np.isfinite(upper[:2]).all() and upper[2] == np.inf
    assert np.allclose(upper[:2], 1.6, atol=0.05) and np.allclose(pace[:2], 1.0, atol=0.02)
    assert np.allclose(share[:2], slow[:, :2].mean(axis=0)) and np.isnan(share[2])
    assert (width >= 0.1).all()
