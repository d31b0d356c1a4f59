"""`meshscope detect` judges with the `[detect]` section that applies: `--config`'s, or with
`--run` the run's own config.json (the settings it was judged with live), then `--set`, then
`--sensitivity`; the series knobs (`detect.series.*`) reach a CSV; a bad setting is exit 2
naming it, before anything is read."""

import json
import re
import shutil
from pathlib import Path

import pandas as pd
from typer.testing import CliRunner

from fixtures.recorded import STORES
from meshscope.cli import app

SERIES = Path(__file__).resolve().parents[1] / "data" / "series" / "prometheus_export.csv"
runner = CliRunner()


def _episodes(*args: str) -> int:
    result = runner.invoke(app, ["detect", *args])
    assert result.exit_code == 0, result.output
    return int(re.search(r"(\d+) anomal(?:y|ous) episode\(s\)", result.output).group(1))


def test_a_run_is_judged_with_its_own_detect_section_unless_a_flag_says_otherwise(tmp_path):
    run = tmp_path / "slow"
    shutil.copytree(STORES / "slow", run)
    assert _episodes("--run", str(run)) == 1  # no config.json: the defaults
    (run / "config.json").write_text(json.dumps({"detect": {"sensitivity": 0.001}}))
    assert _episodes("--run", str(run)) == 0  # as it was judged live
    assert _episodes("--run", str(run), "--sensitivity", "1") == 1  # the flag wins
    assert _episodes("--run", str(run), "--set", "detect.sensitivity=1") == 1
    (run / "config.json").write_text(json.dumps({"detect": {"sensitivity": -1}}))
    result = runner.invoke(app, ["detect", "--run", str(run)])  # unreadable: said, then defaults
    assert result.exit_code == 0 and "detect.sensitivity" in result.output, result.output


def test_the_series_settings_reach_a_csv(tmp_path):
    out = tmp_path / "scored.csv"

    def flags(*args: str) -> int:
        out.unlink(missing_ok=True)
        assert _episodes(str(SERIES), "-o", str(out), *args) >= 0
        return int(pd.read_csv(out)["is_anomaly"].sum())

    usual = flags()
    eager = ["--set", "detect.series.alpha=0.01", "--set", "detect.series.pair_alpha=0.2"]
    assert flags(*eager) > usual
    toml = tmp_path / "eager.toml"
    toml.write_text("[detect.series]\nalpha = 0.01\npair_alpha = 0.2\n")
    assert flags("--config", str(toml)) == flags(*eager)


def test_a_bad_detect_setting_is_refused_by_name(tmp_path):
    for args, named in (
        (["--set", "detect.series.alpha=2"], "detect.series.alpha"),
        (["--set", "detect.series.bogus=1"], "detect.series.bogus"),
        (["--set", "train.steps=5"], "train.steps"),
        (["--sensitivity", "0"], "detect.sensitivity"),
        (["--config", str(tmp_path / "missing.toml")], "missing.toml"),
    ):
        result = runner.invoke(app, ["detect", str(SERIES), "-o", str(tmp_path / "o.csv"), *args])
        assert result.exit_code == 2 and named in result.output, (args, result.output)
        assert not (tmp_path / "o.csv").exists()
