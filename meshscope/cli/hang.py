"""`meshscope hang-report`: the hang diagnosis of a run, or of Flight Recorder dumps."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from meshscope.cli.common import app, console, fail, store_errors
from meshscope.collector.store import describe_store, load_events


@app.command("hang-report")
def hang_report(
    run: Path | None = typer.Option(None, "--run", help="a meshscope run directory"),
    flight_recorder: Path | None = typer.Option(
        None,
        "--flight-recorder",
        help="a folder of PyTorch Flight Recorder dumps (<prefix><rank>) of a job that did not run meshscope",
    ),
    prefix: str | None = typer.Option(None, help="Flight Recorder dump names: <prefix><rank>"),
    as_json: bool = typer.Option(False, "--json", help="print the diagnosis as one JSON object"),
) -> None:
    """The last hang diagnosis of a run (else one from its flight logs), or a diagnosis of a
    plain job's PyTorch Flight Recorder dumps."""
    from meshscope.watchdog.watch import diagnose_folder

    if (run is None) == (flight_recorder is None):
        fail("give either --run DIR or --flight-recorder DIR")
    if flight_recorder is not None:
        from meshscope.watchdog.flight_recorder import DumpError, diagnose_dumps

        try:
            diag = diagnose_dumps(flight_recorder, prefix)
        except (DumpError, OSError) as err:
            fail(str(err))
        _print_hang(diag.detail(), f"Flight Recorder dumps in {flight_recorder}", as_json)
        return
    from meshscope.collector.store import StoreError, check_store

    try:
        check_store(run)
        events = load_events(run, kind="hang")
    except FileNotFoundError:
        events = None  # no store (yet): the flight logs may still tell
    except StoreError as err:
        fail(str(err))
    except store_errors() as err:
        fail(f"{describe_store(run)}: not a readable meshscope run store ({err})")
    if events is not None and not events.empty:
        detail, source = events.iloc[-1]["detail"], f"hang event in {describe_store(run)}"
    else:
        diag = diagnose_folder(run / "live")
        if diag is None:
            fail(f"{run}: no hang event and no flight logs in {run / 'live'}")
        detail, source = diag.detail(), f"flight logs in {run / 'live'} (post-mortem)"
    _print_hang(detail, source, as_json)


def _print_hang(detail: dict, source: str, as_json: bool = False) -> None:
    if as_json:
        typer.echo(json.dumps({**detail, "read_from": source}, default=str))
        return
    table = Table(title=f"hang diagnosis ({source})", show_header=False)
    for key in ("type", "culprit_ranks", "op", "seq", "group", "waiting_ranks", "why", "action", "source"):
        if detail.get(key) is not None:
            table.add_row(key, str(detail[key]))
    console.print(table)
    for op in detail.get("stuck_groups") or []:  # every op ranks wait in: who for, and the root
        what = f"{op['op']} #{op['seq']}" if op.get("seq") is not None else op["op"]
        how = (
            ""
            if op["independent"] or not op["culprit_ranks"]
            else f", through other waits to {op['culprit_ranks']}"
        )
        console.print(
            f"  group {op['group']}, {what}: ranks {op['waiting_ranks']} wait on {op['waiting_on']}{how}",
            markup=False,
            highlight=False,
        )
    for rank, stack in sorted((detail.get("stacks") or {}).items()):
        console.print(f"[bold]rank {rank}[/] (innermost last)")
        for line in stack[-8:]:
            console.print(f"    {line}", markup=False, highlight=False)


@app.command("hang-watch")
def hang_watch(
    run: Path = typer.Option(..., "--run", help="the run directory your Monitor writes (its run_dir)"),
    abort: bool = typer.Option(False, "--abort", help="also kill the stuck workers (torchrun restarts them)"),
    hang_after: float | None = typer.Option(None, "--hang-after", min=0.1, help="seconds of stall to count"),
) -> None:
    """Watch a job you launched yourself (the Monitor SDK) for hangs, beside torchrun on each
    node: a hang is printed, stored as an event, and with --abort its workers are killed. Ends
    when every rank's flight log is closed (the run ended)."""
    import time

    from meshscope.collector.flightread import latest_logs
    from meshscope.collector.rundir import live_dir
    from meshscope.watchdog.config import HangConfig
    from meshscope.watchdog.watch import HangWatch, pid_alive

    settings: dict = {"on_hang": "abort" if abort else "report"}
    if hang_after is not None:
        settings["min_stall_s"] = hang_after
    config = HangConfig(**settings)
    if not run.is_dir() and not run.resolve().parent.is_dir():  # a typo, not a job yet to start
        fail(f"--run {run}: neither it nor its parent folder {run.resolve().parent} exists")
    if not run.is_dir():
        console.print(f"{run} does not exist yet: waiting for the job to create it")
    console.print(f"watching {live_dir(run)} for hangs (Ctrl-C to stop)")
    watch = HangWatch(live_dir(run), config, on_hang=lambda diag: _on_hang(run, diag, config.on_hang)).start()
    try:
        while True:
            time.sleep(1.0)
            heads = latest_logs(live_dir(run)) if live_dir(run).is_dir() else {}
            if heads and all(h.closed or not pid_alive(h.pid) for h in heads.values()):
                console.print("every rank closed its flight log or is gone: the run ended")
                return
    except KeyboardInterrupt:
        return
    finally:
        watch.stop()


def _on_hang(run: Path, diag, action: str) -> None:  # noqa: ANN001
    """A hang seen by `hang-watch`: stored as the run's event, printed, and (abort) ended."""
    from meshscope.collector.rundir import live_dir
    from meshscope.collector.schema import Event
    from meshscope.collector.store import RunStore
    from meshscope.sidecar import kill_all

    detail = {**diag.detail(), "action": action}
    store = RunStore(run)
    try:
        step = diag.step
        store.add_event(Event(kind="hang", run_id=run.name, severity="critical", step=step, detail=detail))
    finally:
        store.close()
    if action == "abort":
        kill_all(diag.pids.values())
    _print_hang(detail, f"live flight logs in {live_dir(run)}")
