"""One source of thresholds: rules.yml is rendered from `detectors.thresholds`, and on the same
numbers the StragglerRank alert (promtool) and the engine's straggler detector agree."""

import subprocess

import numpy as np
import pytest
import yaml

from meshscope.dashboards.prometheus import RULES, render_rules
from meshscope.detectors.domain import Straggler
from meshscope.detectors.thresholds import Thresholds
from tests.conftest import require_binary


def test_the_committed_rules_are_rendered_from_the_thresholds():
    assert RULES.read_text() == render_rules(), "run: python -m dashboards.prometheus --write-rules"


def test_changing_a_threshold_changes_the_rule():
    rules = yaml.safe_load(render_rules(Thresholds(straggler_ratio=2.5, comm_ratio=0.7)))
    exprs = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert exprs["StragglerRank"].endswith("> 2.5") and exprs["CommRatioHigh"].endswith("> 0.7")


def _engine_verdict(compute: list[float], ratio: float) -> set[int]:
    normal = np.full((30, len(compute)), 0.1)
    return {int(r) for r in Straggler(ratio=ratio).fit(normal).culprits(np.asarray([compute]))[0]}


CASES = [  # (ranks, slow ranks): fewer than half straggle, where a median means the same
    (2, [1]),
    (4, [2]),
    (5, [0, 3]),
    (8, []),
]


@pytest.mark.parametrize("ranks, slow", CASES)
@pytest.mark.parametrize("offset", [-0.15, 0.15])
def test_promtool_and_the_engine_agree_on_stragglers(tmp_path, ranks, slow, offset):
    promtool = require_binary("promtool")
    t = Thresholds().straggler_ratio
    compute = [0.1 * (t + offset) if r in slow else 0.1 for r in range(ranks)]
    expected = _engine_verdict(compute, t)
    assert expected == (set(slow) if offset > 0 else set())  # the engine's own line
    series = []
    for r, c in enumerate(compute):
        base = f'job="meshscope",run="ra",rank="{r}",node="n"'
        series += [
            {"series": f'meshscope_step_phase_seconds{{{base},phase="forward"}}', "values": f"{c}x30"},
            {"series": f'meshscope_step_phase_seconds{{{base},phase="comm_exposed"}}', "values": "0x30"},
        ]
    alerts = [
        {
            "exp_labels": {"severity": "warning", "run": "ra", "rank": str(r), "node": "n"},
            "exp_annotations": {
                "summary": f"Rank {r} of run ra computes {t + offset:.2f}x the median rank",
                "description": "Its forward+backward+optimizer time is well above its peers'; "
                "they wait for it in every collective.",
                "value": f"{t + offset:.2f}",
            },
        }
        for r in sorted(expected)
    ]
    (tmp_path / "rules.yml").write_text(render_rules())
    (tmp_path / "agree_test.yml").write_text(
        yaml.safe_dump(
            {
                "rule_files": ["rules.yml"],
                "evaluation_interval": "1s",
                "tests": [
                    {
                        "interval": "1s",
                        "input_series": series,
                        "alert_rule_test": [
                            {"eval_time": "20s", "alertname": "StragglerRank", "exp_alerts": alerts}
                        ],
                    }
                ],
            }
        )
    )
    out = subprocess.run(
        [promtool, "test", "rules", str(tmp_path / "agree_test.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
