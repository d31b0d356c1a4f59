"""The numpy feature path and the packed forest give the numbers their references give."""

import numpy as np
import pandas as pd
from sklearn.ensemble import IsolationForest

from meshscope.detectors.features import STEP_FEATURES, step_features, step_views
from meshscope.detectors.isolation import PackedForest
from tests.detectors.test_engine import synthetic_run


def test_packed_forest_scores_equal_scikit_learn():
    rng = np.random.default_rng(1)
    train = rng.standard_normal((300, 6))
    forest = IsolationForest(random_state=0).fit(train)
    rows = np.vstack([3 * rng.standard_normal((200, 6)), train[:5], [[1e6] * 6]])
    np.testing.assert_allclose(
        PackedForest(forest).score_samples(rows), forest.score_samples(rows), rtol=0, atol=1e-12
    )


def test_step_features_match_a_pandas_groupby():
    df = synthetic_run(steps=30, ranks=3, nan_at=(1, 12))
    got = step_features(df)
    g = df.groupby("step")
    assert list(got.columns) == STEP_FEATURES and list(got.index) == list(range(30))
    np.testing.assert_allclose(got["step_spread"], g["step_s"].max() / g["step_s"].median())
    np.testing.assert_allclose(got["loss"], g["loss"].mean())  # pandas skips the NaN too
    assert got.loc[12, "loss_delta"] == got.loc[12, "loss"] - got.loc[11, "loss"]
    assert (got["mem_slope"] == 0).all()


def test_steps_a_rank_has_not_written_are_left_out():
    df = synthetic_run(steps=5, ranks=2)
    df = df[~((df["step"] == 3) & (df["rank"] == 1))].sample(frac=1, random_state=0)  # any order
    views = list(step_views(df, after=0))
    assert [v.step for v in views] == [1, 2, 4]
    assert all(list(v.ranks) == [0, 1] for v in views)
    assert pd.Series([len(v.cols["loss"]) for v in views]).eq(2).all()


def test_a_feature_that_sat_still_does_not_make_the_first_wiggle_an_anomaly():
    """Memory that did not grow in the window (IQR 0) then grows 4 KB in a step: not anomalous
    with a floor of 1 MiB/step; without one, the step is a million IQRs out."""
    from meshscope.detectors.isolation import OnlineIsolationForest

    rng = np.random.default_rng(0)
    X = np.column_stack([1 + 0.02 * rng.standard_normal(300), np.zeros(300)])
    wiggle = [[1.0, 4096.0]]
    floored = OnlineIsolationForest(min_scale=(0.05, float(1 << 20))).fit(X)
    bare = OnlineIsolationForest().fit(X)
    assert floored.predict(wiggle)[0] == 1 and bare.predict(wiggle)[0] == -1
    assert floored.predict([[1.0, 64.0 * (1 << 20)]])[0] == -1  # a real jump still is
