"""One parametrized check of the scikit-learn estimator contract for every detector."""

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.exceptions import NotFittedError

from meshscope.detectors.domain import ExpertBalance, MemoryGrowth, NonFinite, PersistentStraggler, Straggler
from meshscope.detectors.isolation import OnlineIsolationForest
from meshscope.detectors.moving import EWMA, RobustZ

rng = np.random.default_rng(0)
NORMAL = 1.0 + 0.05 * rng.standard_normal((60, 3))
CASES = [
    (RobustZ(), NORMAL, NORMAL[0] * [1, 1, 5]),
    (EWMA(), NORMAL, NORMAL[0] * [1, 1, 5]),
    (OnlineIsolationForest(n_estimators=50), NORMAL, NORMAL[0] * [1, 1, 8]),
    (Straggler(), NORMAL, NORMAL[0] * [1, 1, 3]),
    (PersistentStraggler(), NORMAL, NORMAL[0] * [1, 1, 1.6]),
    (
        ExpertBalance(),
        np.full((5, 4), 0.25) + 0.01 * rng.standard_normal((5, 4)),
        np.array([0.7, 0.1, 0.1, 0.1]),
    ),
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


def test_set_params_moves_the_decision_and_unfitted_use_raises_not_fitted():
    import numpy as np
    import pytest
    from sklearn.exceptions import NotFittedError

    from meshscope.detectors.domain import ExpertBalance, ExpertLoad, MemoryGrowth, NonFinite, Straggler
    from meshscope.detectors.isolation import OnlineIsolationForest
    from meshscope.detectors.moving import EWMA, RobustZ

    for det in (
        Straggler(),
        PersistentStraggler(),
        ExpertBalance(),
        ExpertLoad(),
        MemoryGrowth(),
        NonFinite(),
        RobustZ(),
        EWMA(),
        OnlineIsolationForest(n_estimators=5),
    ):
        with pytest.raises(NotFittedError):
            det.score_samples(np.ones((3, 2)))
        with pytest.raises(NotFittedError):
            det.decision_function(np.ones((3, 2)))
    X = np.ones((20, 3))
    X[-1, 2] = 1.7  # rank 2 at 1.7x its peers
    s = Straggler(ratio=1.5).fit(X[:-1])
    assert s.predict(X[-1:])[0] == -1
    s.set_params(ratio=2.0)  # no stale threshold: the decision follows the parameter
    assert s.predict(X[-1:])[0] == 1


@pytest.mark.parametrize(
    "det,param",
    [
        ("Straggler(ratio=0.9)", "ratio"),
        ("Straggler(window=0)", "window"),
        ("PersistentStraggler(min_excess=0)", "min_excess"),
        ("PersistentStraggler(span=0)", "span"),
        ("ExpertLoad(top_k=0)", "top_k"),
        ("MemoryGrowth(mb_per_step=-1)", "mb_per_step"),
        ("RobustZ(threshold=-1)", "threshold"),
        ("EWMA(alpha=0)", "alpha"),
        ("OnlineIsolationForest(n_estimators=0)", "n_estimators"),
    ],
)
def test_bad_hyperparameters_are_refused_naming_them(det, param):
    import numpy as np

    from meshscope.detectors.domain import ExpertLoad, MemoryGrowth, PersistentStraggler, Straggler  # noqa: F401
    from meshscope.detectors.isolation import OnlineIsolationForest  # noqa: F401
    from meshscope.detectors.moving import EWMA, RobustZ  # noqa: F401

    with pytest.raises(ValueError, match=param):
        eval(det).fit(np.ones((10, 2)))
