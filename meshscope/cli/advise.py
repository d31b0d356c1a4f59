"""`meshscope advise`: every uniform parallel layout of a model on a cluster, ranked by
predicted step time, calibrated on the job's own runs when given."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from meshscope.cli.common import app, console, err_console, fail


def _settings(items: list[str]) -> dict:
    """`--set KEY=VALUE` pairs for the advisor's config (values read as TOML)."""
    from meshscope.cli.settings import apply_set_options

    try:
        return apply_set_options(items, {})
    except typer.BadParameter as err:
        fail(str(err))
    return {}


def _inputs(model_file: Path, cluster_file: Path, settings: list[str]):
    from meshscope.advisor.specs import SpecError, load_cluster, load_model, load_settings

    try:
        cluster = load_cluster(cluster_file)
        return load_model(model_file), cluster, load_settings(cluster_file, _settings(settings))
    except SpecError as err:
        fail(str(err))
    raise AssertionError  # unreachable: fail exits


def _row_dict(row) -> dict:
    keys = (
        "label",
        "tp",
        "pp",
        "cp",
        "dp",
        "ep",
        "mb",
        "m",
        "v",
        "dist_opt",
        "step_s",
        "step_lo_s",
        "step_hi_s",
    )
    keys += ("tokens_per_s", "memory_gib", "oom_risk", "comm_ratio", "rank_skew", "bound", "compute_s")
    keys += ("comm_exposed_s", "a2a_s", "bubble_s", "other_s")
    out = {k: row[k].item() if hasattr(row[k], "item") else row[k] for k in keys}
    from meshscope.advisor.layouts import RECOMPUTE

    out["recompute"] = RECOMPUTE[int(row["recompute"])]
    return out


def _print_table(advice, cluster, top: int) -> None:
    table = Table(
        title=f"{advice.evaluated} layouts on {cluster.devices} × {cluster.device.name}; best {top}"
    )
    for col in ("#", "layout", "step s (interval)", "tokens/s", "GiB/device", "comm", "largest part"):
        table.add_column(col)
    for i, row in advice.ranked.head(top).iterrows():
        memory = f"{row.memory_gib:.1f}" + (" OOM risk" if row.oom_risk else "")
        interval = f"{row.step_s:.3g} ({row.step_lo_s:.3g}–{row.step_hi_s:.3g})"
        table.add_row(
            str(i + 1),
            row.label,
            interval,
            f"{row.tokens_per_s:,.0f}",
            memory,
            f"{row.comm_ratio:.0%}",
            row.bound,
        )
    console.print(table)


def _print_best(advice) -> None:
    from meshscope.advisor.cost import PARTS

    best = advice.best()
    if best is None:
        return
    parts = ", ".join(f"{name} {best[key]:.3g} s" for key, name in PARTS.items() if best[key] > 0)
    console.print(f"best: {best.label}: {parts}; rank skew {best.rank_skew:.2f}", highlight=False)


def _print_factors(factors) -> None:
    table = Table(title="efficiency factors")
    for col in ("factor", "value", "from"):
        table.add_column(col)
    for name in factors.names():
        table.add_row(name, f"{getattr(factors, name):.4g}", factors.source(name))
    console.print(table)


@app.command()
def advise(
    model: Path = typer.Option(..., "--model", help="model TOML (layers, hidden, heads, experts, ...)"),
    cluster: Path = typer.Option(..., "--cluster", help="cluster TOML (nodes, devices, memory, links)"),
    calibrate: list[Path] = typer.Option(
        [], "--calibrate", help="a meshscope run directory measured on this cluster (repeatable)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print the ranked layouts as JSON"),
    settings: list[str] = typer.Option(
        [],
        "--set",
        help="advisor setting KEY=VALUE (`meshscope config --advisor` lists them), e.g. goal=memory",
    ),
) -> None:
    """Rank every uniform layout (DP/TP/PP/EP/CP, micro-batches, recompute, distributed
    optimizer) by predicted step time, with memory per device and the binding constraint."""
    from meshscope.advisor.advise import advise as search
    from meshscope.advisor.calibrate import calibrate as fit_runs

    spec, hardware, cfg = _inputs(model, cluster, settings)
    for run in calibrate:
        if not run.is_dir():
            fail(f"--calibrate {run}: not a run directory")
    fitted = fit_runs(calibrate, hardware) if calibrate else None
    if fitted is not None:
        for path, why in fitted.skipped.items():
            err_console.print(f"warning: --calibrate {path} left out: {why}")
        for note in fitted.notes:
            err_console.print(f"note: {note}")
        if "expert_skew" not in spec.model_fields_set and fitted.runs:
            skew = max(r.expert_skew for r in fitted.runs)
            spec = spec.model_copy(update={"expert_skew": skew})
            fitted.factors.measured["expert_skew"] = ", ".join(r.path.name for r in fitted.runs)
    advice = search(spec, hardware, cfg, fitted.factors if fitted else None)
    if as_json:
        print(json.dumps(_as_json(advice, cfg.top), indent=1))
        return
    _print_table(advice, hardware, cfg.top)
    _print_best(advice)
    console.print(f"binding constraint: {advice.binding}", highlight=False)
    _print_factors(advice.factors)
    for note in advice.notes:
        console.print(f"note: {note}", highlight=False)


def _as_json(advice, top: int) -> dict:
    return {
        "evaluated": advice.evaluated,
        "binding": advice.binding,
        "layouts": [_row_dict(row) for _, row in advice.ranked.head(top).iterrows()],
        "factors": {
            name: {"value": getattr(advice.factors, name), "from": advice.factors.source(name)}
            for name in advice.factors.names()
        },
        "notes": advice.notes,
    }
