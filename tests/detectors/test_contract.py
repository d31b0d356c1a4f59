"""One parametrized check of the scikit-learn estimator contract for every detector."""
import numpy as np
import pytest
from sklearn.base import clone
from sklearn.exceptions import NotFittedError

from detectors.domain import ExpertBalance, MemoryGrowth, NonFinite, Straggler
from detectors.isolation import OnlineIsolationForest
from detectors.moving import EWMA, RobustZ

rng = np.random.default_rng(0)
NORMAL = 1.0 + 0.05 * rng.standard_normal((60, 3))
CASES = [
    (RobustZ(), NORMAL, NORMAL[0] * [1, 1, 5]),
    (EWMA(), NORMAL, NORMAL[0] * [1, 1, 5]),
    (OnlineIsolationForest(n_estimators=50), NORMAL, NORMAL[0] * [1, 1, 8]),
    (Straggler(), NORMAL, NORMAL[0] * [1, 1, 3]),
    (ExpertBalance(), np.full((5, 4), 0.25) + 0.01 * rng.standard_normal((5, 4)),
     np.array([0.7, 0.1, 0.1, 0.1])),
    (NonFinite(), NORMAL, np.array([1.0, np.nan, 1.0])),
    (MemoryGrowth(), np.full((10, 2), 1e9), np.array([1e9, 1e9 + 200 * 2**20])),
]


@pytest.mark.parametrize("detector, train, outlier", CASES, ids=lambda c: type(c).__name__)
def test_estimator_contract(detector, train, outlier):
    params = detector.get_params()
    assert clone(detector).get_params() == params  # __init__ stores hyperparameters only
    assert not [k for k in vars(detector) if k.endswith("_")]  # no learnt state before fit
    with pytest.raises(NotFittedError):
        detector.decision_function(train[:1])
    assert detector.fit(train) is detector
    assert [k for k in vars(detector) if k.endswith("_")]
    normal, odd = np.median(train, axis=0).reshape(1, -1), outlier.reshape(1, -1)
    assert detector.score_samples(odd)[0] < detector.score_samples(normal)[0]
    assert detector.decision_function(odd)[0] < 0 <= detector.decision_function(normal)[0]
    assert detector.predict(np.vstack([normal, odd])).tolist() == [1, -1]
