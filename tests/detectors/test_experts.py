"""Expert load judged in units that mean the same for any (experts, top-k)."""

import numpy as np
import pandas as pd
import pytest

from fixtures.recorded import expert_scores
from meshscope.detectors.domain import ExpertLoad
from meshscope.detectors.window_rules import ExpertRule


def balanced_noise(experts, rows=8, seed=0, spread=0.15):
    rng = np.random.default_rng(seed)
    x = (1 / experts) * (1 + spread * rng.standard_normal((rows, experts)))
    x = np.clip(x, 1e-4, None)
    return x / x.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("experts,top_k", [(4, 2), (8, 2), (16, 4), (64, 8), (4, 1)])
def test_a_collapse_scores_one_and_balance_scores_nothing(experts, top_k):
    det = ExpertLoad(top_k=top_k).fit(balanced_noise(experts))
    collapse = np.full((1, experts), (1 - 1 / top_k) / (experts - 1))
    collapse[0, 0] = 1 / top_k  # every token's slot includes expert 0: the most top-k allows
    # top-1: the others get nothing and starve too; otherwise they share what is left
    assert det.culprits(collapse)[0] == ([0, *range(1, experts)] if top_k == 1 else [0])
    assert det.factors(collapse)[0][0] == pytest.approx(1.0)
    assert det.culprits(np.full((1, experts), 1 / experts))[0] == []
    assert (det.factors(balanced_noise(experts, seed=1)) <= 1).all()  # bounded


def test_a_move_toward_balance_is_never_an_anomaly():
    experts = 8  # the demo: an expert at 0.065 moved to 0.14 (balanced 0.125)
    usual = np.full((6, experts), (1 - 0.065) / 7)
    usual[:, 2] = 0.065
    det = ExpertLoad(top_k=2).fit(usual)
    moved = np.full((1, experts), (1 - 0.14) / 7)
    moved[0, 2] = 0.14
    assert det.culprits(moved)[0] == []
    skewed = np.full((6, experts), 0.1)  # and a usually hot expert cooling down
    skewed[:, 0] = 0.3
    skewed /= skewed.sum(axis=1, keepdims=True)
    cooled = np.full((1, experts), 1 / experts)
    assert ExpertLoad(top_k=2).fit(skewed).culprits(cooled)[0] == []


def test_a_starving_expert_is_found_and_a_usually_idle_one_is_not():
    experts = 8
    det = ExpertLoad(top_k=2).fit(balanced_noise(experts))
    starving = np.full((1, experts), 1 / 7)
    starving[0, 5] = 0.0
    assert det.culprits(starving)[0] == [5]
    idle = np.tile(starving, (6, 1))  # an expert that never got tokens is its layer's normal
    assert ExpertLoad(top_k=2).fit(idle).culprits(starving)[0] == []


def test_the_rule_reads_top_k_from_the_counts():
    experts, top_k, tokens_per_step, every = 8, 2, 1000.0, 5
    rows = []
    for window, step in enumerate(range(every - 1, 100, every)):
        share = balanced_noise(experts, rows=1, seed=window)[0]
        if step >= 60:
            share = np.full(experts, (1 - 1 / top_k) / (experts - 1))
            share[3] = 1 / top_k
        tokens = share * tokens_per_step * every * top_k  # each token counted k times
        rows += [{"step": step, "layer": 0, "expert": e, "tokens": t} for e, t in enumerate(tokens)]
    rule = ExpertRule(warmup=20, hog_min=0.5)
    rule.tokens_per_step = tokens_per_step
    flags = rule.judge(pd.DataFrame(rows))
    assert rule.detectors[0].top_k == top_k
    first = min(flags, key=lambda f: f[0])
    assert first[0] == 64 and first[1].expert == 3 and first[1].score == pytest.approx(1.0)
    assert first[1].evidence["kind"] == "hog" and first[1].evidence["max_share"] == 0.5


# --- recorded runs at several (experts, top-k): fixtures/stores/experts ----------------------
@pytest.mark.parametrize("use_config", [True, False], ids=["top-k from config", "top-k inferred"])
def test_collapses_hogs_and_starvation_found_within_3_steps_and_clean_runs_silent(use_config):
    table = expert_scores(use_config)
    for kind, row in table.items():
        if kind == "clean":
            assert row["fp"] == 0 and row["steps"] >= 1600
            continue
        assert row["fn"] == 0 and row["fp"] == 0, (kind, row)
        assert max(row["delays"]) <= 3, (kind, row)
