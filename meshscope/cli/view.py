"""`meshscope view`: the Streamlit root-cause view over a runs folder."""

from __future__ import annotations

from pathlib import Path

import typer

from meshscope.cli.common import app, console, err_console, fail


def _port_free(host: str, port: int) -> None:
    """Exit 2 before the view announces itself where Streamlit could not listen."""
    from meshscope.collector.exporter import PortInUseError, ensure_ports_free

    try:
        ensure_ports_free(host, [port])
    except PortInUseError:
        fail(f"--port {port} on {host}: not free here; choose another with --port (or --host)")


def _streamlit_flags(host: str, port: int) -> list[str]:
    """Streamlit's server flags: headless on `host:port`, no telemetry, no file watcher."""
    flags = {
        "server.headless": "true",
        "server.address": host,
        "server.port": str(port),
        "browser.gatherUsageStats": "false",
        "server.fileWatcherType": "none",
        "client.toolbarMode": "viewer",
    }
    return [arg for name, value in flags.items() for arg in (f"--{name}", value)]


def _readable_token(path: Path) -> None:
    """Exit 2 unless the token file can be read and holds a token."""
    from meshscope.alerts.notify import AlertSettingError, read_secret

    try:
        read_secret(file=path, flag="--allow-changes")
    except AlertSettingError as err:
        fail(str(err))


@app.command()
def view(
    runs: Path = typer.Option(Path("runs"), "--runs", help="folder of run directories"),
    port: int = typer.Option(8501, help="port on 127.0.0.1"),
    host: str = typer.Option("127.0.0.1", help="address to listen on"),
    grafana_url: str | None = typer.Option(None, help="Grafana base URL for board links"),
    prometheus_url: str | None = typer.Option(None, help="Prometheus, for live runs"),
    allow_changes: Path | None = typer.Option(
        None,
        "--allow-changes",
        help="a file holding a token: the Feedback page may then queue changes to a live job, "
        "each approval giving the token (without it the view only reads)",
    ),
) -> None:
    """The root-cause view (Streamlit) over the runs folder; alerts link into it."""
    import os
    import sys

    import meshscope.view
    from meshscope.view.settings import ViewSettings

    try:
        settings = ViewSettings(
            runs_dir=runs,
            port=port,
            host=host,
            grafana_url=grafana_url,
            prometheus_url=prometheus_url,
            changes_token_file=allow_changes.resolve() if allow_changes else None,
        )
    except ValueError as err:
        fail(str(err).splitlines()[0])
    if allow_changes is not None:
        _readable_token(allow_changes)
    _port_free(host, port)
    if not runs.is_dir():
        err_console.print(
            f"[yellow]warning:[/] {runs} does not exist yet: the view shows runs as they appear"
        )
    app_py = Path(meshscope.view.__file__).with_name("app.py")
    cmd = [sys.executable, "-m", "streamlit", "run", str(app_py), *_streamlit_flags(host, port)]
    mode = "may queue changes, with the token" if allow_changes else "read-only"
    console.print(f"meshscope view on http://{host}:{port} ({mode}; runs in {runs.resolve()})")
    sys.stdout.flush()
    # become Streamlit: a SIGTERM to `meshscope view` reaches the server, which frees its port
    os.execve(sys.executable, cmd, {**os.environ, **settings.env()})
