"""`meshscope detect FILE.csv`: scores an exported series; malformed input is a clear exit 2."""
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from meshscope.cli import app

DATA = Path(__file__).resolve().parents[1] / "data" / "series" / "prometheus_export.csv"
runner = CliRunner()


def test_spike_and_level_shift_found_and_slow_wave_ignored(tmp_path):
    out = tmp_path / "scored.csv"
    result = runner.invoke(app, ["detect", str(DATA), "--time-column", "time", "--output", str(out)])
    assert result.exit_code == 0, result.output
    scored = pd.read_csv(out)
    assert list(scored.columns[-2:]) == ["anomaly_score", "is_anomaly"]
    flagged = set(scored.index[scored["is_anomaly"]])
    assert 250 in flagged and 320 in flagged  # the spike, the start of the shift
    assert not flagged - set(range(250, 252)) - set(range(320, 345))  # nothing on the wave


def test_value_columns_and_sensitivity(tmp_path):
    out = tmp_path / "scored.csv"
    runner.invoke(app, ["detect", str(DATA), "--value-columns", "comm_ratio", "-o", str(out)])
    assert 250 not in set(pd.read_csv(out).query("is_anomaly").index)  # spike is in the other column
    runner.invoke(app, ["detect", str(DATA), "--sensitivity", "0.2", "-o", str(out)])
    assert pd.read_csv(out)["is_anomaly"].sum() < 10


@pytest.mark.parametrize("content, args, message", [
    ("", [], "empty"),
    ("t,v\n1,2\n", ["--time-column", "time"], "no column 'time'"),
    ("time,v\n1,2\n2,abc\n", [], "non-numeric value 'abc' at data row 2"),
    ("time,v\n1,2\n", ["--value-columns", "w"], "no column(s) 'w'"),
])
def test_malformed_csv_exits_2_with_a_clear_message(tmp_path, content, args, message):
    bad = tmp_path / "bad.csv"
    bad.write_text(content)
    result = runner.invoke(app, ["detect", str(bad), *args])
    assert result.exit_code == 2
    assert message in result.output
