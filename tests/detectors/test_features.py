"""The numpy feature path and the packed forest give the numbers their references give."""
import numpy as np
import pandas as pd
from sklearn.ensemble import IsolationForest

from detectors.features import STEP_FEATURES, step_features, step_views
from detectors.isolation import PackedForest
from tests.detectors.test_engine import synthetic_run


def test_packed_forest_scores_equal_scikit_learn():
    rng = np.random.default_rng(1)
    train = rng.standard_normal((300, 6))
    forest = IsolationForest(random_state=0).fit(train)
    rows = np.vstack([3 * rng.standard_normal((200, 6)), train[:5], [[1e6] * 6]])
    np.testing.assert_allclose(PackedForest(forest).score_samples(rows), forest.score_samples(rows),
                               rtol=0, atol=1e-12)


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
