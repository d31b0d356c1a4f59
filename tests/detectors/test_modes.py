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


def _two_means_by_masked_medians(rows):
    """The two-means as first written, each group's median by a masked `np.nanmedian` every
    iteration: the sort-based `paces_and_modes` must find the same modes."""
    low, high = np.percentile(rows, 10, axis=0), np.percentile(rows, 90, axis=0)
    for _ in range(8):
        upper = np.abs(rows - high) < np.abs(rows - low)
        low, high = _reference_median(rows, ~upper, low), _reference_median(rows, upper, high)
    return low, high, upper.mean(axis=0)


@settings(max_examples=150, deadline=None)
@given(
    shape=st.tuples(st.integers(5, 60), st.integers(1, 5)),
    slow_share=st.floats(0.0, 0.9),
    ties=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_modes_are_those_of_the_two_means_by_masked_medians(shape, slow_share, ties, seed):
    rng = np.random.default_rng(seed)
    rows = (1 + 0.03 * rng.standard_normal(shape)) * np.where(rng.random(shape) < slow_share, 1.6, 1.0)
    rows = np.round(rows, 1) if ties else rows
    low, high, share = _two_means_by_masked_medians(rows)
    pace, upper, _, found = paces_and_modes(rows)
    two = np.isfinite(upper)
    assert np.array_equal(pace[two], low[two]) and np.array_equal(
        upper[two], high[two] / np.maximum(low[two], 1e-12)
    )
    assert np.array_equal(found[two], share[two])
