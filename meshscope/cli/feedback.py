"""`meshscope feedback ingest|apply|outcomes|export`: the training-inference loop."""

from __future__ import annotations

import getpass
from pathlib import Path

import typer
from rich.table import Table

from meshscope.cli.common import _run_dir, app, console, fail
from meshscope.collector.store import load_events

feedback_app = typer.Typer(
    no_args_is_help=True, help="Serving-side expert load in, suggestions out, outcomes measured."
)


app.add_typer(feedback_app, name="feedback")


@feedback_app.command("ingest")
def feedback_ingest(
    file: Path = typer.Argument(
        ...,
        help="SGLang expert-distribution .pt, vLLM EPLB load .pt, "
        "or CSV (layer, expert, tokens[, latency_ms])",
    ),
    run: Path = typer.Option(..., "--run", help="the training run it feeds back into"),
    devices: int = typer.Option(8, min=1, help="serving devices for the placement suggestion"),
) -> None:
    """Diagnose serving load against the run and store ranked suggestions."""
    from meshscope.feedback.knowledge import knowledge_base
    from meshscope.feedback.loop import ingest
    from meshscope.feedback.serving import FeedbackError

    run = _run_dir(run)
    try:
        data = file.read_bytes()
    except OSError as err:
        fail(f"{file}: cannot read ({err.strerror})")
    try:
        report = ingest(run, data, file.name, devices=devices, kb=knowledge_base(run.parent))
    except FeedbackError as err:
        fail(str(err))
    table = Table(title=f"serving load ({report.source}) against {run.name}")
    for col in ("layer", "serving bal.", "training bal.", "hot", "cold", "latency cost ms"):
        table.add_column(col)
    for d in report.diagnoses:
        table.add_row(
            str(d.layer),
            f"{d.serving_balancedness:.2f}",
            "-" if d.training_balancedness is None else f"{d.training_balancedness:.2f}",
            str(d.hot),
            str(d.cold),
            "-" if d.latency_cost_ms is None else f"{d.latency_cost_ms:.1f}",
        )
    console.print(table)
    if not report.suggestions:
        console.print("every layer is balanced enough: nothing to suggest")
    for sid, s in zip(report.event_ids, report.suggestions):
        console.print(
            f"[bold]#{sid}[/] {s.action} ({s.target}, layer {s.layer}) expected {s.expected}", highlight=False
        )
        console.print(f"     {s.why}", markup=False, highlight=False)
    console.print(f"approve one: meshscope feedback apply --run {run} --suggestion ID")


@feedback_app.command("apply")
def feedback_apply(
    run: Path = typer.Option(..., "--run", help="the running training run"),
    suggestion: int = typer.Option(..., "--suggestion", help="a suggestion's id (from ingest)"),
) -> None:
    """Approve a suggestion: the running trainer applies it at its next control step."""
    from meshscope.collector.controls import ControlError
    from meshscope.feedback.loop import approve
    from meshscope.feedback.serving import FeedbackError

    run = _run_dir(run)
    try:
        cid = approve(run, suggestion, by=f"{getpass.getuser()} (meshscope feedback apply)")
    except (FeedbackError, ControlError) as err:
        fail(str(err))
    console.print(
        f"change #{cid} queued: the trainer applies it at its next control step "
        "(see `suggestion_applied` events)"
    )


@feedback_app.command("outcomes")
def feedback_outcomes(
    run: Path = typer.Option(..., "--run", help="a run with applied changes"),
    after: int = typer.Option(50, min=2, help="steps after a change before it is judged"),
) -> None:
    """Measure applied changes against their prediction; store them in the knowledge base."""
    from meshscope.feedback.knowledge import knowledge_base
    from meshscope.feedback.loop import settle_outcomes

    run = _run_dir(run)
    done = settle_outcomes(run, knowledge_base(run.parent), after=after)
    for o in done:
        console.print(
            f"change #{o['control']} ({o['action']}): balancedness "
            f"{o['balancedness_before']:.2f} → {o['balancedness_after']:.2f} "
            f"({o['balancedness_gain']:+.0%}), loss x{o['loss_ratio']:.3f}, "
            f"step time x{o['step_s_ratio']:.2f}: "
            f"{'worked' if o['success'] else 'did not work'}",
            highlight=False,
        )
    if not done:
        console.print("no applied change has run long enough to judge")


@feedback_app.command("export")
def feedback_export(
    run: Path = typer.Option(..., "--run", help="a run with ingested serving load"),
    output: Path = typer.Option(Path("placement.json"), "--output", "-o"),
) -> None:
    """Write the latest serving placement suggestions (replicas, slots, devices) as JSON."""
    from meshscope.feedback.loop import export_placement
    from meshscope.feedback.suggestions import Suggestion

    run = _run_dir(run)
    events = load_events(run, kind="suggestion")
    rows = [
        Suggestion(**{k: v for k, v in d.items() if k in Suggestion.__dataclass_fields__})
        for d in events["detail"]
        if d.get("action") == "placement"
    ]
    if not rows:
        fail(f"{run}: no placement suggestion; run `meshscope feedback ingest` first")
    latest = {s.layer: s for s in rows}  # the newest per layer
    console.print(str(export_placement(list(latest.values()), output)))
