"""The maturity level a run reached is read from what it did, cumulatively, with what the next
level needs."""

import json

import pandas as pd

from meshscope.collector.maturity import maturity


def _events(*rows):
    return pd.DataFrame(rows, columns=["kind", "time", "step", "detail"])


def _steps(ranks, times=(1.0, 2.0, 3.0)):
    return pd.DataFrame(
        [(r, i, t) for r in ranks for i, t in enumerate(times)], columns=["rank", "step", "time"]
    )


def test_one_rank_is_not_yet_data_parallel_and_says_what_l1_needs(tmp_path):
    level = maturity(tmp_path, _steps([0]), _events(("run_start", 0.5, -1, {"compression": "none"})))
    assert level.level == 0 and "--nproc 2" in level.text()


def test_each_level_needs_its_own_evidence_and_every_level_below(tmp_path):
    start = ("run_start", 0.5, -1, {"compression": "fp16"})
    assert (
        maturity(tmp_path, _steps([0, 1]), _events(("run_start", 0.5, -1, {"compression": "none"}))).level
        == 1
    )
    assert maturity(tmp_path, _steps([0, 1]), _events(start)).level == 2
    resumed = ("resume", 1.5, 1, {"from_step": 1})
    three = maturity(tmp_path, _steps([0, 1]), _events(start, resumed))
    assert three.level == 3 and "L4 needs" in three.text() and "resumed from step 1" in three.evidence["L3"]
    # watched: the detector's endpoint in the run's targets
    targets = [{"targets": ["127.0.0.1:9402"], "labels": {"job": "meshscope_detector", "run": "r"}}]
    (tmp_path / "targets.json").write_text(json.dumps(targets))
    assert maturity(tmp_path, _steps([0, 1]), _events(start, resumed)).level == 4
    applied = ("suggestion_applied", 2.5, 2, {"status": "applied"})
    outcome = ("outcome", 2.8, 3, {"success": True})
    five = maturity(tmp_path, _steps([0, 1]), _events(start, resumed, applied, outcome))
    assert five.level == 5 and five.text().startswith("L5")
    # adaptive without the levels below it is not L5: no resume, no L3
    assert maturity(tmp_path, _steps([0, 1]), _events(start, applied, outcome)).level == 2


def test_a_resume_that_no_step_followed_is_not_elastic(tmp_path):
    events = _events(("run_start", 0.5, -1, {"compression": "fp16"}), ("resume", 9.0, 2, {"from_step": 2}))
    assert maturity(tmp_path, _steps([0, 1]), events).level == 2
