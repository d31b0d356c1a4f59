"""What every command shares: the Typer app, the consoles, and failing with exit 2."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from meshscope.collector.store import describe_store

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Observability and debugging for distributed (MoE) training.",
)


console = Console()


err_console = Console(stderr=True, soft_wrap=True)  # messages stay whole for grep


def fail(message: str, code: int = 2) -> None:
    """Print the error and exit (2: bad input, before anything started)."""
    err_console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code)


@app.callback()
def main() -> None:
    """meshscope: instrumented training, detectors, tracer and boards."""


def _readable_store(run: Path) -> None:
    """Exit 2 with the reason when `run` holds no readable meshscope run store."""
    from meshscope.collector.store import StoreError, check_store

    try:
        check_store(run)
    except FileNotFoundError:
        fail(f"{run}: no run store there ({describe_store(run)})")
    except StoreError as err:
        fail(str(err))


def _run_dir(run: Path) -> Path:
    _readable_store(run)
    return run
