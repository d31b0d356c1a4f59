"""`meshscope dashboards build|publish`: the Grafana boards as code."""

from __future__ import annotations

from pathlib import Path

import typer

from meshscope.cli.common import app, console, fail

boards_app = typer.Typer(no_args_is_help=True, help="Grafana boards generated as code.")


app.add_typer(boards_app, name="dashboards")


@boards_app.command("build")
def dashboards_build(
    check: bool = typer.Option(False, help="exit 1 if the committed JSON is not up to date"),
) -> None:
    """Write the boards' JSON (dashboards/grafana/dashboards) and the compose configs
    (dashboards/compose), or check that the committed ones are current."""
    from meshscope.dashboards.boards import OUT, build_all, render, write_all
    from meshscope.dashboards.compose import FOLDER, compose_configs, write_compose_configs

    if check:
        wanted = {OUT / f"{n}.json": render(b) for n, b in build_all().items()}
        wanted |= {FOLDER / n: text for n, text in compose_configs().items()}
        stale = [str(p) for p, text in wanted.items() if not p.exists() or p.read_text() != text]
        if stale:
            fail(f"out of date: {', '.join(stale)}; run `meshscope dashboards build`", code=1)
        console.print("boards and compose configs up to date")
        return
    for path in write_all() + write_compose_configs():
        console.print(str(path))


@boards_app.command("publish")
def dashboards_publish(
    url: str = typer.Option(..., help="Grafana base URL, e.g. http://127.0.0.1:3000"),
    token_file: Path = typer.Option(..., help="file holding a Grafana service-account token"),
) -> None:
    """Upload every board into Grafana's `meshscope` folder (overwriting older versions)."""
    from meshscope.dashboards.publish import PublishError, publish, read_token

    try:
        done = publish(url, read_token(token_file))
    except PublishError as err:
        fail(str(err), code=1)
    for board in done:
        console.print(f"{board.name:9} {board.url}  (version {board.version})")
