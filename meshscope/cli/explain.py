"""`meshscope explain`: a run's probable causes, ranked, with evidence."""

from __future__ import annotations

from pathlib import Path

import typer

from meshscope.cli.common import _readable_store, app, console, fail, store_errors
from meshscope.collector.store import describe_store


@app.command()
def explain(
    run: Path = typer.Option(..., "--run", help="a meshscope run directory"),
    anomaly: int | None = typer.Option(
        None, "--anomaly", help="one anomaly's event id (as the view and alerts link it)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print the causes as JSON"),
    limit: int = typer.Option(5, min=1, help="causes to print"),
) -> None:
    """Probable causes of what went wrong in a run (or one anomaly), ranked, with evidence."""
    import json

    from meshscope.explain.facts import UnknownAnomaly
    from meshscope.explain.ranking import explain as rank_causes

    _readable_store(run)
    try:
        causes = rank_causes(run, anomaly)
    except UnknownAnomaly as err:
        fail(str(err.args[0]))
    except store_errors() as err:
        fail(f"{describe_store(run)}: not a readable meshscope run store ({err})")
    if as_json:
        print(json.dumps([c.as_dict() for c in causes[:limit]], indent=1))
        return
    if not causes:
        console.print(f"{run}: nothing to explain (no anomaly, hang, NaN or death recorded)")
    for i, c in enumerate(causes[:limit], 1):
        console.print(f"[bold]{i}. {c.kind}[/] ({c.confidence:.0%}) {c.title}", markup=True, highlight=False)
        for line in c.evidence:
            console.print(f"     - {line}", markup=False, highlight=False)
        console.print(f"     next: {c.action}", markup=False, highlight=False)
    if anomaly is None:
        _where_the_time_went(run)


def _where_the_time_went(run: Path) -> None:
    """The run's time account: ETTR, then every bucket that took time, largest first."""
    from meshscope.collector.report import efficiency

    account = efficiency(run)["account"]
    console.print("[bold]where the time went[/]", markup=True, highlight=False)
    console.print(f"     {account.text(top=0)}", markup=False, highlight=False)
    for bucket, share in sorted(account.shares().items(), key=lambda kv: -kv[1]):
        if share >= 0.0005:
            seconds = account.job[bucket]
            console.print(f"     - {bucket}: {seconds:.2f} s ({share:.1%})", markup=False, highlight=False)
