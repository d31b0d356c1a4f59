"""`meshscope detect FILE.csv`: scores an exported series; malformed input is a clear exit 2."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from meshscope.cli import app
from meshscope.detectors.series import SeriesConfig, SeriesError, estimate_period, flag_episodes, score_frame

DATA = Path(__file__).resolve().parents[1] / "data" / "series" / "prometheus_export.csv"
runner = CliRunner()


def test_spike_and_level_shift_found_and_slow_wave_ignored(tmp_path):
    out = tmp_path / "scored.csv"
    result = runner.invoke(app, ["detect", str(DATA), "--time-column", "time", "--output", str(out)])
    assert result.exit_code == 0, result.output
    scored = pd.read_csv(out)
    assert list(scored.columns[-3:]) == ["anomaly_score", "is_anomaly", "in_episode"]
    # one flag per episode, at its onset: the spike, the start of the shift; nothing on the wave
    assert list(scored.index[scored["is_anomaly"]]) == [250, 320]
    assert scored["anomaly_score"].between(0, 1).all()


def test_value_columns_and_sensitivity(tmp_path):
    out = tmp_path / "scored.csv"
    result = runner.invoke(app, ["detect", str(DATA), "--value-columns", "comm_ratio", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert 250 not in set(pd.read_csv(out).query("is_anomaly").index)  # spike is in the other column
    counts = []
    for sensitivity in ("0.001", "1", "1000"):
        out.unlink(missing_ok=True)  # a failed run must not count the previous run's file
        result = runner.invoke(app, ["detect", str(DATA), "--sensitivity", sensitivity, "-o", str(out)])
        assert result.exit_code == 0, (sensitivity, result.output)
        counts.append(int(pd.read_csv(out)["is_anomaly"].sum()))
    assert counts[0] <= counts[1] < counts[2]


@pytest.mark.parametrize(
    "content, args, message",
    [
        ("", [], "empty"),
        ("t,v\n1,2\n", ["--time-column", "time"], "no column 'time'"),
        ("time,v\n1,2\n2,abc\n", [], "non-numeric value 'abc' at data row 2"),
        ("time,v\n1,2\n", ["--value-columns", "w"], "no column(s) 'w'"),
    ],
)
def test_malformed_csv_exits_2_with_a_clear_message(tmp_path, content, args, message):
    bad = tmp_path / "bad.csv"
    bad.write_text(content)
    result = runner.invoke(app, ["detect", str(bad), *args])
    assert result.exit_code == 2
    assert message in result.output


N, DAY = 2016, 288  # a week at 5 minutes


def _score(values, **config):
    frame = pd.DataFrame({"time": np.arange(len(values)), "v": values})
    return score_frame(frame, "time", config=SeriesConfig(**config))


def _daily(period=DAY):
    phase = (np.arange(N) % period) / period
    return 20 + 60 * np.clip((np.sin(2 * np.pi * (phase - 0.25)) + 0.3) * 2, 0, 1)


@pytest.mark.parametrize(
    "name, values",
    [
        ("square wave", np.where(np.arange(N) % DAY < DAY // 2, 20.0, 80.0)),
        ("noiseless daily pattern", _daily()),
        ("daily pattern, fractional period", _daily(287.5) + np.random.default_rng(1).normal(0, 1, N)),
        ("flat line", np.full(N, 7.0)),
        ("white noise", np.random.default_rng(2).normal(50, 2, N)),
        ("quantised counter", np.random.default_rng(3).poisson(3, N).astype(float)),
    ],
)
def test_clean_series_raise_nothing_once_their_shape_is_known(name, values):
    scored = _score(values)
    assert not scored["is_anomaly"].iloc[2 * DAY :].any(), name  # two cycles show the season


@pytest.mark.parametrize("kind", ["spike", "level shift", "variance", "stuck", "missing pulse"])
def test_each_anomaly_gives_one_flag_at_its_onset(kind):
    rng = np.random.default_rng(4)
    x, onset = rng.normal(50, 2, N), 1500
    if kind == "spike":
        x[onset] += 25
    elif kind == "level shift":
        x[onset:] += 10
    elif kind == "variance":
        x[onset:] = 50 + (x[onset:] - 50) * 5
    elif kind == "stuck":
        x[onset : onset + 200] = x[onset - 1]
    else:
        x = np.where(np.arange(N) % DAY < DAY // 2, 20.0, 80.0)
        onset = 5 * DAY
        x[onset : onset + DAY // 2] = 80.0
    flags = np.flatnonzero(_score(x)["is_anomaly"].to_numpy())
    flags = flags[flags >= 2 * DAY]
    assert len(flags) == 1 and onset <= flags[0] <= onset + 10, (kind, flags)


def test_two_unusual_rows_in_a_row_open_an_episode_one_does_not():
    config = SeriesConfig()
    marginal = (config.alpha + config.pair_alpha) / 2  # unusual, yet not enough on its own
    tails = np.ones(3000)
    tails[100] = marginal  # a stray draw
    tails[[200, 201]] = marginal  # a change that lasts: the second row confirms it
    tails[[400, 401]] = marginal  # the scale still learns what the episode at 201 left
    tails[[1300, 1301]] = marginal  # long after it: a new episode
    tails[1400] = config.alpha / 2  # far out on its own: an episode even while the scale learns
    onset, _ = flag_episodes(tails, config)
    assert list(np.flatnonzero(onset)) == [201, 1301, 1400]
    assert not flag_episodes(tails, config.model_copy(update={"pair_alpha": config.alpha}))[0][201]


def test_the_score_ranks_an_episodes_onset_above_the_rows_that_follow_it():
    """A level shift is news once: a threshold that keeps its onset keeps no later row of the
    same episode, while a spike after the episode ranks as news again."""
    rng = np.random.default_rng(5)
    x = rng.normal(50, 2, N)
    x[1000:] += 10  # the episode: a new level the scale takes rows to learn
    x[1900] += 40  # later news
    scored = _score(x)
    onsets = np.flatnonzero(scored["is_anomaly"].to_numpy())
    assert 1000 <= onsets[0] <= 1005 and 1900 in onsets, onsets
    score, episode = scored["anomaly_score"].to_numpy(), scored["in_episode"].to_numpy()
    after_onset = np.flatnonzero(episode[:1900])
    after_onset = after_onset[after_onset > onsets[0]]
    assert len(after_onset) > 5 and score[after_onset].max() < score[onsets[0]], score[after_onset].max()
    assert score[1900] >= score[onsets[0]] * 0.99


def test_online_a_row_is_judged_from_the_rows_before_it_only():
    rng = np.random.default_rng(5)
    x = _daily() + rng.normal(0, 1, N)
    x[1200] += 30
    whole, prefix = _score(x), _score(x[:1000])
    assert np.array_equal(whole["anomaly_score"].to_numpy()[:1000], prefix["anomaly_score"].to_numpy())
    assert np.array_equal(whole["is_anomaly"].to_numpy()[:1000], prefix["is_anomaly"].to_numpy())


def test_scores_are_bounded_whatever_the_magnitudes():
    x = np.r_[np.zeros(200), 1e300, np.full(100, -1e300), np.full(50, np.nan), np.arange(100.0)]
    score = _score(x)["anomaly_score"]
    assert score.notna().all() and score.between(0, 1).all()


def test_the_season_is_found_from_the_past():
    assert estimate_period(_daily()[:700], 1500, 0.6) == DAY
    assert estimate_period(np.arange(700.0), 1500, 0.6) is None  # a trend is not a season
    assert estimate_period(np.r_[np.zeros(350), np.ones(350)], 1500, 0.6) is None  # nor a step


def test_the_time_column_is_found_by_its_usual_names(tmp_path):
    csv = tmp_path / "export.csv"
    csv.write_text(
        "timestamp,value\n"
        + "".join(f"2026-01-01 00:{i // 60:02d}:{i % 60:02d},{i % 7}\n" for i in range(100))
    )
    result = runner.invoke(app, ["detect", str(csv), "-o", str(tmp_path / "out.csv")])
    assert result.exit_code == 0, result.output
    assert list(pd.read_csv(tmp_path / "out.csv").columns[:2]) == ["timestamp", "value"]
    nameless = tmp_path / "nameless.csv"
    nameless.write_text("a,b\n1,2\n")
    result = runner.invoke(app, ["detect", str(nameless)])
    assert result.exit_code == 2 and "--time-column" in result.output


def test_bad_config_names_the_field():
    with pytest.raises(SeriesError, match="alpha"):
        SeriesConfig.with_sensitivity(1.0, alpha=2)
    with pytest.raises(SeriesError, match="sensitivity"):
        SeriesConfig.with_sensitivity(0)


@pytest.mark.parametrize("amplitude, period", [(0.05, 200), (0.05, 500), (0.2, 500), (1.0, 200)])
def test_a_larger_anomaly_after_a_smaller_episode_is_still_found(amplitude, period):
    """The scale learns the noise, not what it flagged: a 30-row +0.08 episode (20 sd) must not
    make the later +0.3 spike look normal (the tails once fitted the episode's edges)."""
    rng = np.random.default_rng(0)
    n = 3000
    values = 1 + amplitude * np.sin(np.arange(n) * 2 * np.pi / period) + rng.normal(0, 0.004, n)
    values[1500:1530] += 0.08
    values[2400] += 0.3
    scored = score_frame(pd.DataFrame({"time": np.arange(n), "v": values}), "time")
    onsets = list(scored.index[scored["is_anomaly"]])
    assert onsets and 1500 <= onsets[0] <= 1502, onsets
    assert 2400 in onsets, (onsets, scored["anomaly_score"][2400])


def test_rows_out_of_time_order_come_back_in_the_input_order(tmp_path):
    frame = pd.read_csv(DATA)
    shuffled = frame.sample(frac=1.0, random_state=7)
    path = tmp_path / "shuffled.csv"
    shuffled.to_csv(path, index=False)
    out = tmp_path / "scored.csv"
    assert runner.invoke(app, ["detect", str(path), "-o", str(out)]).exit_code == 0
    scored = pd.read_csv(out)
    # row for row, the input's rows, with the scores the time-ordered series gives them
    assert scored["time"].tolist() == shuffled["time"].tolist()
    in_order = score_frame(frame, "time").set_index("time")["anomaly_score"]
    assert np.allclose(scored["anomaly_score"].to_numpy(), in_order.loc[shuffled["time"]].to_numpy())
