"""`meshscope detect`: judge a run's steps, or score a CSV time series."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from meshscope.cli.common import _readable_store, app, console, fail, store_errors
from meshscope.collector.store import describe_store, load_steps


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
    sensitivity: float = typer.Option(1.0, help="> 1 flags more, < 1 flags less"),
) -> None:
    """Judge a run (anomaly events into its store) or score a CSV (anomaly_score, is_anomaly)."""
    if (csv is None) == (run is None):
        fail("give either a CSV file or --run DIR")
    if csv is not None:
        _detect_csv(csv, time_column, value_columns, output, sensitivity)
    else:
        _detect_run(run, sensitivity)


def _detect_csv(
    path: Path, time_column: str | None, value_columns: str | None, output: Path | None, sensitivity: float
) -> None:
    from meshscope.detectors.series import SeriesError, read_series, score_frame

    try:
        cols = [c.strip() for c in value_columns.split(",")] if value_columns else None
        if cols is not None and (len(set(cols)) < len(cols) or "" in cols):
            fail(f"--value-columns {value_columns}: name each column once")
        frame = read_series(str(path), time_column, cols)  # the time column first
        scored = score_frame(frame, str(frame.columns[0]), sensitivity=sensitivity)
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


def _detect_run(run: Path, sensitivity: float) -> None:
    from meshscope.detectors.live import LiveDetection
    from meshscope.detectors.thresholds import EngineConfig

    _readable_store(run)
    try:
        steps = load_steps(run)
        config = EngineConfig(sensitivity=sensitivity)
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
