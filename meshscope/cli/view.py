"""`meshscope view`: the Streamlit root-cause view over a runs folder."""

from __future__ import annotations

from pathlib import Path

import typer

from meshscope.cli.common import app, console, err_console, fail


@app.command()
def view(
    runs: Path = typer.Option(Path("runs"), "--runs", help="folder of run directories"),
    port: int = typer.Option(8501, help="port on 127.0.0.1"),
    host: str = typer.Option("127.0.0.1", help="address to listen on"),
    grafana_url: str | None = typer.Option(None, help="Grafana base URL for board links"),
    prometheus_url: str | None = typer.Option(None, help="Prometheus, for live runs"),
) -> None:
    """The root-cause view (Streamlit) over the runs folder; alerts link into it."""
    import os
    import sys

    import meshscope.view
    from meshscope.view.settings import ViewSettings

    try:
        settings = ViewSettings(
            runs_dir=runs, port=port, host=host, grafana_url=grafana_url, prometheus_url=prometheus_url
        )
    except ValueError as err:
        fail(str(err).splitlines()[0])
    if not runs.is_dir():
        err_console.print(
            f"[yellow]warning:[/] {runs} does not exist yet: the view will show runs as they appear there"
        )
    app_py = Path(meshscope.view.__file__).with_name("app.py")
    cmd = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(app_py),
        "--server.headless",
        "true",
        "--server.address",
        host,
        "--server.port",
        str(port),
        "--browser.gatherUsageStats",
        "false",
        "--server.fileWatcherType",
        "none",
        "--client.toolbarMode",
        "viewer",
    ]
    console.print(f"meshscope view on http://{host}:{port} (runs in {runs.resolve()})")
    sys.stdout.flush()
    # become Streamlit: a SIGTERM to `meshscope view` reaches the server, which frees its port
    os.execve(sys.executable, cmd, {**os.environ, **settings.env()})
