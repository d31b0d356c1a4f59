"""What every command shares: the Typer app, the consoles, and failing with exit 2."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

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


class LazyModule:
    """`name`, imported on first use: every command's module is imported to register it, and
    one command's heavy imports (torch, scikit-learn) must not slow every other command. Not
    put in sys.modules (code that walks it, as `inspect` does, would load it half-way)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)


def store_errors() -> tuple[type[Exception], ...]:
    """What reading a damaged run store raises (called in an `except`: pandas loads only then)."""
    import sqlite3

    import pandas as pd

    return (sqlite3.DatabaseError, pd.errors.DatabaseError)


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
