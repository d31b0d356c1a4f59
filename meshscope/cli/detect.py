"""`meshscope detect`: judge a run's steps, or score a CSV time series."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from meshscope.cli.common import _readable_store, app, console, err_console, fail, store_errors
from meshscope.collector.store import describe_store, load_steps
from meshscope.detectors.thresholds import EngineConfig


@app.command()
def detect(
    csv: Path | None = typer.Argument(None, help="a CSV time series to score"),
    run: Path | None = typer.Option(None, "--run", help="a run directory to judge"),
    time_column: str | None = typer.Option(
        None, "--time-column", help="CSV: the time column (default: time, timestamp, ts, date or datetime)"
    ),
    value_columns: str | None = typer.Option(
        None, "--value-columns", help="CSV: columns to score, A,B (default: all)"
    ),
    output: Path | None = typer.Option(None, "--output", "-o", help="CSV: where to write"),
    sensitivity: float | None = typer.Option(
        None, help="> 1 flags more, < 1 flags less (default: detect.sensitivity, 1)"
    ),
    config: Path | None = typer.Option(
        None,
        "--config",
        "-c",
        help="a TOML whose [detect] section applies (default with --run: the run's own config.json)",
    ),
    set_: list[str] | None = typer.Option(
        None,
        "--set",
        help="a detect setting, repeatable: detect.PATH=VALUE, e.g. detect.series.alpha=1e-5 "
        "(every one: `meshscope config`)",
    ),
) -> None:
    """Judge a run (anomaly events into its store) or score a CSV (anomaly_score, is_anomaly)."""
    if (csv is None) == (run is None):
        fail("give either a CSV file or --run DIR")
    settings = _detect_settings(run, config, set_ or [], sensitivity)
    if csv is not None:
        _detect_csv(csv, time_column, value_columns, output, settings)
    else:
        _detect_run(run, settings)


def _detect_settings(
    run: Path | None, config: Path | None, settings: list[str], sensitivity: float | None
) -> EngineConfig:
    """The `[detect]` section that applies: `--config`'s (or the run's own, with `--run`), then
    `--set`, then `--sensitivity`. Refused with the field's name before anything is read."""
    from meshscope.cli.settings import apply_set_options
    from meshscope.config import ConfigError, load_config

    if other := [item for item in settings if not item.strip().startswith("detect.")]:
        fail(f"--set {other[0]}: only detect.* settings apply to `meshscope detect`")
    flags = {"detect": {"sensitivity": sensitivity}} if sensitivity is not None else {}
    overrides = apply_set_options(settings, flags)
    own = run / "config.json" if config is None and run is not None else None
    try:
        return load_config(config or (own if own and own.is_file() else None), overrides).detect
    except ConfigError as err:
        if config is not None or own is None:
            fail(str(err))
        why = escape(str(err))
        err_console.print(f"[yellow]warning:[/] {why}; judging with the default \\[detect] settings")
        try:
            return load_config(None, overrides).detect
        except ConfigError as err2:
            fail(str(err2))


def _detect_csv(
    path: Path,
    time_column: str | None,
    value_columns: str | None,
    output: Path | None,
    cfg: EngineConfig,
) -> None:
    from meshscope.detectors.series import SeriesConfig, SeriesError, read_series, score_frame

    try:
        cols = [c.strip() for c in value_columns.split(",")] if value_columns else None
        if cols is not None and (len(set(cols)) < len(cols) or "" in cols):
            fail(f"--value-columns {value_columns}: name each column once")
        series = SeriesConfig.with_sensitivity(cfg.sensitivity, **cfg.series.model_dump())
        frame = read_series(str(path), time_column, cols)  # the time column first
        scored = score_frame(frame, str(frame.columns[0]), config=series)
    except SeriesError as err:
        fail(str(err))
    output = output or path.with_name(path.stem + ".scored.csv")
    scored.to_csv(output, index=False)
    console.print(
        f"{int(scored['is_anomaly'].sum())} anomalous episode(s) "
        f"({int(scored['in_episode'].sum())} of {len(scored)} rows); scores written to {output}"
    )


def _ship_to_job_store(run: Path) -> None:
    """A run on a job store: the anomalies just written to this folder's file go there too."""
    from meshscope.collector.relay import StoreRelay
    from meshscope.collector.store import RELAY_TABLES, store_path
    from meshscope.collector.storedb import locate

    target = locate(run)
    if target.is_postgres and not StoreRelay(store_path(run), target, RELAY_TABLES).drain(retry_s=10):
        fail(f"{describe_store(run)} does not answer: the anomalies wait in {store_path(run)}", code=1)


def _detect_run(run: Path, config: EngineConfig) -> None:
    from meshscope.detectors.live import LiveDetection

    _readable_store(run)
    try:
        steps = load_steps(run)
    except (FileNotFoundError, ValueError) as err:
        fail(str(err))
    except store_errors() as err:
        # corrupt, truncated, or a SQLite file that is not a meshscope run store
        fail(f"{describe_store(run)}: not a readable meshscope run store ({err})")
    run_id = str(steps["run_id"].iloc[0]) if not steps.empty else run.name
    episodes = LiveDetection(run, run_id, config).stop()  # one pass; events into the store
    _ship_to_job_store(run)
    table = Table(title=f"anomalies in {run}")
    for col in ("type", "ranks", "layer/expert", "steps", "score", "evidence"):
        table.add_column(col)
    for ep in sorted(episodes, key=lambda e: e.start_step):
        where = f"{ep.layer}/{ep.expert}" if ep.layer is not None else ""
        table.add_row(
            ep.type,
            ",".join(map(str, ep.ranks)),
            where,
            f"{ep.start_step}-{ep.end_step}",
            f"{ep.score:.2f}",
            str(ep.evidence)[:60],
        )
    console.print(table)
    console.print(f"{len(episodes)} anomaly episode(s) written to {describe_store(run)}")
