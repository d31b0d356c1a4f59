"""`meshscope` command line: parse, build, run, close. The work lives in the packages."""

from __future__ import annotations

import json
import math
import socket
import sqlite3
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pandas as pd
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from collector.exporter import PortInUseError, remove_from_index
from collector.report import summarize
from collector.store import load_events, load_expert_load, load_steps, store_path
from detectors.notify import Outbox
from meshscope import launcher
from trainer.config import ConfigError, RunConfig, load_config, merge_settings
from trainer.device import DeviceUnavailable

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Observability and debugging for distributed (MoE) training.",
)
console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # messages stay whole for grep


def fail(message: str, code: int = 2) -> None:
    err_console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code)


def _nest(out: dict[str, Any], path: list[str], value: Any) -> None:
    """Put `value` at `path` in nested dicts, creating sections; ValueError if one is a value."""
    node = out
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"{part} is not a section")
    node[path[-1]] = value


def _overrides(**flags: Any) -> dict[str, Any]:
    """Flags that were given, as a nested dict over the config ("train.steps" -> train/steps)."""
    out: dict[str, Any] = {}
    for dotted, value in flags.items():
        if value is not None:
            _nest(out, dotted.split("__"), value)
    return out


def _merge_settings(settings: list[str], flags: dict[str, Any]) -> dict[str, Any]:
    """`--set PATH=VALUE` pairs under the named flags (a flag wins over --set for one field).
    VALUE is read as a TOML value (8, 0.5, true, "text"); anything else is a string."""
    out: dict[str, Any] = {}
    for item in settings:
        path, sep, raw = item.partition("=")
        if not sep or not path.strip():
            raise typer.BadParameter(f"--set {item!r}: expected PATH=VALUE, e.g. train.steps=100")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        try:
            _nest(out, path.strip().split("."), value)
        except ValueError as err:
            raise typer.BadParameter(f"--set {item!r}: {err}") from None
    return merge_settings(out, flags)


@app.callback()
def main() -> None:
    """meshscope: instrumented training, detectors, tracer and boards."""


@app.command()
def run(
    config: Path | None = typer.Option(None, "--config", "-c", help="TOML config file"),
    steps: int | None = typer.Option(None, help="optimizer steps"),
    nproc: int | None = typer.Option(None, help="worker processes (default 4)"),
    compression: str | None = typer.Option(None, help="none | fp16 | powersgd | onebit"),
    no_overlap: bool = typer.Option(False, "--no-overlap", help="all-reduce after backward"),
    device: str | None = typer.Option(None, help="auto | cpu | cuda | npu"),
    backend: str | None = typer.Option(
        None, help="auto | gloo | nccl | hccl (auto = the device's; gloo shares one device)"
    ),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="runs are created under this folder"),
    run_id: str | None = typer.Option(None, "--run-id", help="name of the run (default: timestamp)"),
    metrics_port: int | None = typer.Option(None, "--metrics-port", help="base port; rank r = base + r"),
    linger: float | None = typer.Option(None, help="keep /metrics up N s after the last step"),
    inject: list[str] | None = typer.Option(
        None, help="fault to inject, repeatable: KIND@step=S,rank=R[,steps=N][,k=v]"
    ),
    checkpoint_every: int | None = typer.Option(None, help="checkpoint every N steps"),
    max_restarts: int | None = typer.Option(None, help="torchrun restarts after a failure"),
    nnodes: str | None = typer.Option(None, help="agents MIN[:MAX] (elastic membership)"),
    rdzv_endpoint: str | None = typer.Option(None, help="c10d rendezvous host:port"),
    rdzv_external: bool = typer.Option(
        False, "--rdzv-external", help="the rendezvous store runs apart (meshscope rendezvous)"
    ),
    slack_webhook_file: Path | None = typer.Option(
        None, help="file holding a Slack incoming-webhook URL (or env MESHSCOPE_SLACK_WEBHOOK)"
    ),
    email_to: str | None = typer.Option(None, help="alert recipients, a@x,b@y"),
    smtp: str | None = typer.Option(None, help="SMTP host:port for email alerts (127.0.0.1:25)"),
    smtp_from: str | None = typer.Option(None, help="sender of email alerts"),
    smtp_user: str | None = typer.Option(None, help="SMTP login"),
    smtp_password_file: Path | None = typer.Option(None, help="file holding the SMTP password"),
    on_hang: str = typer.Option(
        "report",
        "--on-hang",
        help="report: a hang event and alert naming the culprit; abort: "
        "also kill the workers so torchrun restarts them from the "
        "last checkpoint",
    ),
    trace: str | None = typer.Option(
        None,
        help="tensor tracer: off | nonfinite (default: first non-finite module) | stats "
        "(+ per-module statistics) | full (+ snapshots)",
    ),
    hang_after: float | None = typer.Option(
        None,
        "--hang-after",
        help="seconds without progress before a stall is a hang (at least; slow steps raise it; default 3)",
    ),
    view_url: str | None = typer.Option(
        None, "--view-url", help="the root-cause view alerts link to (default http://127.0.0.1:8501)"
    ),
    alerts: str | None = typer.Option(
        None,
        "--alerts",
        help="auto (default): through Alertmanager when a `meshscope stack` "
        "watches this runs folder, else from the run itself; "
        "alertmanager; embedded",
    ),
    smtp_tls: bool | None = typer.Option(
        None, "--smtp-tls/--no-smtp-tls", help="require STARTTLS for email (default; as `stack up` does)"
    ),
    stack_home: Path | None = typer.Option(
        None, "--stack-home", help="where `meshscope stack up` keeps its state"
    ),
    set_: list[str] | None = typer.Option(
        None,
        "--set",
        help="any config field, repeatable: PATH=VALUE, e.g. train.powersgd_rank=8 "
        "or elastic.keep=5 (every field: `meshscope config`)",
    ),
) -> None:
    """Train the reference MoE model under torchrun with meshscope watching."""
    try:
        cfg = load_config(
            config,
            _merge_settings(
                set_ or [],
                _overrides(
                    train__steps=steps,
                    nproc=nproc,
                    train__compression=compression,
                    train__overlap=False if no_overlap else None,
                    device=device,
                    backend=backend,
                    runs_root=run_dir,
                    run_id=run_id,
                    metrics_port=metrics_port,
                    linger_s=linger,
                    inject=inject or None,
                    elastic__checkpoint_every=checkpoint_every,
                    elastic__max_restarts=max_restarts,
                    elastic__nnodes=nnodes,
                    elastic__rdzv_endpoint=rdzv_endpoint,
                    elastic__rdzv_external=True if rdzv_external else None,
                    trace=trace,
                    view_url=view_url,
                    alerts__mode=alerts,
                    alerts__slack_webhook_file=slack_webhook_file,
                    alerts__email_to=email_to,
                    alerts__smtp=smtp,
                    alerts__smtp_from=smtp_from,
                    alerts__smtp_user=smtp_user,
                    alerts__smtp_password_file=smtp_password_file,
                    alerts__smtp_tls=smtp_tls,
                    alerts__stack_home=stack_home,
                ),
            ),
        )
        channels = _alert_channels(cfg.alerts)  # checked before any write
        channels = _alert_route(cfg.alerts.mode, channels, cfg.runs_root, cfg.alerts.stack_home)
        hang = _hang_config(on_hang, hang_after)
        cfg = launcher.prepare_run(cfg)
    except (ConfigError, DeviceUnavailable, PortInUseError, ValueError) as err:
        fail(str(err))
    console.print(
        f"run [bold]{cfg.run_id}[/]: {cfg.nproc} ranks on {cfg.device} "
        f"({cfg.backend}), "
        f"compression={cfg.train.compression}, overlap={cfg.train.overlap}"
    )
    console.print(f"  store    {store_path(cfg.run_dir)}")
    console.print(
        f"  metrics  http://127.0.0.1:{cfg.metrics_port}..{cfg.metrics_port + cfg.nproc - 1}"
        f"/metrics   (Prometheus file_sd: {cfg.run_dir / 'targets.json'})"
    )
    outbox = Outbox(cfg.run_dir / "outbox", channels) if channels else None
    detection = _start_detection(cfg, outbox, hang)
    code = _train_with_progress(cfg)
    episodes = detection.stop()
    if code != 0:  # a dead run stays in Prometheus' index: RankDown/RecoveryFailed fire
        err_console.print(launcher.tail_log(cfg), markup=False, highlight=False)
        fail(f"training failed (exit {code}); logs in {cfg.run_dir / 'logs'}", code=1)
    remove_from_index(cfg.run_dir, cfg.run_id)
    _print_summary(cfg)
    if episodes:
        console.print(
            f"{len(episodes)} anomaly episode(s): "
            + "; ".join(f"{e.type} ranks={e.ranks} steps {e.start_step}-{e.end_step}" for e in episodes)
        )


def _alert_route(alerts: str, channels: list, runs_root: Path, stack_home: Path) -> list:
    """One alert path: a run under a stack's Prometheus alerts through its Alertmanager (the
    AnomalyDetected and HangDetected rules), never also from its own outbox; the channels the
    run should send to itself otherwise. ValueError naming the flag when it cannot be."""
    from dashboards.stack import alerting_for

    if alerts not in ("auto", "alertmanager", "embedded"):
        raise ValueError(f"--alerts {alerts!r}: expected auto, alertmanager or embedded")
    alertmanager = alerting_for(stack_home, runs_root) if alerts != "embedded" else None
    if alerts == "alertmanager" and alertmanager is None:
        raise ValueError(
            f"--alerts alertmanager: no meshscope stack in {stack_home} watches "
            f"{runs_root} (start one: meshscope stack up --runs {runs_root})"
        )
    if alertmanager is None:
        return channels
    console.print(f"  alerts   through Alertmanager at {alertmanager} (its receivers)")
    if channels:
        err_console.print(
            "[yellow]warning:[/] --slack-webhook-file/--email-to ignored: this run "
            "alerts through Alertmanager, which pages once; --alerts embedded "
            "sends from the run instead"
        )
    return []


def _alert_channels(alerts: Any) -> list:
    """Alert channels from the `alerts` config (TOML and flags) and secrets (files or
    environment); AlertSettingError (a ValueError naming the flag) when one is unusable."""
    from detectors.notify import Email, SlackWebhook, parse_host_port, read_secret

    channels = []
    url = read_secret(
        file=alerts.slack_webhook_file, env="MESHSCOPE_SLACK_WEBHOOK", flag="--slack-webhook-file"
    )
    if url:
        channels.append(SlackWebhook(url))
    if alerts.email_to:
        host, port = parse_host_port(alerts.smtp, "--smtp")
        channels.append(
            Email(
                host,
                port,
                alerts.smtp_from,
                alerts.email_to.split(","),
                username=alerts.smtp_user,
                password=read_secret(file=alerts.smtp_password_file, flag="--smtp-password-file"),
                starttls=alerts.smtp_tls,
            )
        )
    return channels


def _hang_config(on_hang: str, hang_after: float | None):
    """The hang watchdog's settings from the flags; ValueError naming the flag otherwise."""
    from detectors.hang import HangConfig

    if on_hang not in ("report", "abort"):
        raise ValueError(f"--on-hang {on_hang!r}: expected report or abort")
    if hang_after is not None and not hang_after > 0:
        raise ValueError(f"--hang-after {hang_after}: expected seconds > 0")
    kwargs = {"on_hang": on_hang}
    if hang_after is not None:
        kwargs["min_stall_s"] = hang_after
    return HangConfig(**kwargs)


def _hang_exchange(cfg: RunConfig):
    """With several agents, the watchdogs share flight logs through the rendezvous store."""
    if not cfg.elastic.rdzv_endpoint:
        return None
    from datetime import timedelta

    import torch.distributed as dist

    from detectors.hang import NodeExchange
    from detectors.notify import parse_host_port

    host, port = parse_host_port(cfg.elastic.rdzv_endpoint, "--rdzv-endpoint")
    return NodeExchange(
        lambda: dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5)),
        prefix=f"meshscope/hang/{cfg.elastic.rdzv_id or cfg.run_id}",
    )


def _start_detection(cfg: RunConfig, outbox=None, hang=None):
    """The detection engine and the hang watchdog beside training, exporting on the port
    after the ranks'."""
    from collector.exporter import serve_metrics, write_detector_target
    from detectors.live import LiveDetection

    live = LiveDetection(
        cfg.run_dir,
        cfg.run_id,
        outbox=outbox,
        hang=hang,
        exchange=_hang_exchange(cfg) if hang is not None else None,
        view_url=cfg.view_url,
    )
    port = cfg.metrics_port + cfg.nproc
    try:
        serve_metrics(live.registry, port, host="127.0.0.1")
        write_detector_target(
            cfg.run_dir, run_id=cfg.run_id, host="127.0.0.1", port=port, node=socket.gethostname()
        )
        console.print(f"  detector http://127.0.0.1:{port}/metrics")
    except PortInUseError as err:
        err_console.print(f"[yellow]warning:[/] detector metrics not exported: {err}")
    return live.start()


def _train_with_progress(cfg: RunConfig) -> int:
    columns = (
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[stats]}"),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("train", total=cfg.train.steps, stats="starting torchrun...")

        def on_progress(done: int, last: dict) -> None:
            stats = (
                (
                    f"loss {last.get('loss', math.nan):.3f}  "
                    f"{last.get('tokens_per_s', 0) * cfg.nproc:,.0f} tok/s  "
                    f"comm {last.get('comm_ratio', 0):.0%}"
                )
                if last
                else ""
            )
            progress.update(task, completed=done, stats=stats)

        return launcher.follow(cfg, launcher.launch(cfg), on_progress)


def _compression_cell(s: dict[str, float]) -> str:
    """raw / wire bytes, or why there is no ratio (one rank sends no gradients)."""
    if s["ranks"] <= 1:
        return "n/a (one rank: no gradient traffic)"
    ratio = s["compression_ratio"]
    return f"{ratio:.1f}x" if math.isfinite(ratio) else "n/a (no gradient bytes recorded)"


def _print_summary(cfg: RunConfig) -> None:
    s = summarize(load_steps(cfg.run_dir), load_expert_load(cfg.run_dir))
    kinds = load_events(cfg.run_dir)["kind"].value_counts()
    table = Table(title=f"run {cfg.run_id}", show_header=False)
    rows = [
        ("steps x ranks", f"{s['steps']:.0f} x {s['ranks']:.0f}"),
        ("throughput", f"{s['tokens_per_s']:,.0f} tokens/s"),
        ("step time mean / p99", f"{s['step_s_mean'] * 1e3:.1f} / {s['step_s_p99'] * 1e3:.1f} ms"),
        ("comm ratio (exposed)", f"{s['comm_ratio_mean']:.1%}"),
        ("compression ratio (raw / wire)", _compression_cell(s)),
        ("loss first -> last", f"{s['loss_first']:.3f} -> {s['loss_last']:.3f}"),
        (
            "expert imbalance max / mean",
            f"{s['expert_imbalance_max']:.2f} / {s['expert_imbalance_mean']:.2f}",
        ),
        (
            "injected / faults / restarts / resumes",
            " / ".join(str(int(kinds.get(k, 0))) for k in ("injected", "fault", "restart", "resume")),
        ),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    console.print(f"store: {store_path(cfg.run_dir)}")


def config_fields(model: type[Any] = RunConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(path, type, default, description) of every settable field, read off the config models:
    what the TOML and `--set` take."""
    from pydantic import BaseModel

    rows = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            rows += config_fields(kind, f"{prefix}{name}.")
            continue
        default = field.get_default(call_default_factory=True)
        if get_origin(kind) is Literal:
            type_name = " | ".join(map(str, get_args(kind)))
        else:
            type_name = getattr(kind, "__name__", None) or str(kind).replace("typing.", "")
        shown = str(default) if isinstance(default, Path) else repr(default)
        rows.append((f"{prefix}{name}", type_name, shown, field.description or ""))
    return rows


@app.command("config")
def config_cmd(
    config: Path | None = typer.Option(
        None, "--config", "-c", help="also validate this TOML and show its values"
    ),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per field"),
) -> None:
    """Every config field (TOML section.key, or `meshscope run --set section.key=VALUE`)."""
    values: dict[str, Any] = {}
    if config is not None:
        try:
            cfg = load_config(config)
        except ConfigError as err:
            fail(str(err))
        values = {path: repr(_get_path(cfg, path)) for path, *_ in config_fields()}
    if as_json:
        for path, kind, default, description in config_fields():
            print(
                json.dumps(
                    {
                        "field": path,
                        "type": kind,
                        "default": default,
                        "value": values.get(path),
                        "meaning": description,
                    }
                )
            )
        return
    table = Table(title="meshscope run configuration")
    for column in ("field", "type", "default", *(("value",) if values else ()), "meaning"):
        table.add_column(column)
    for path, kind, default, description in config_fields():
        table.add_row(path, kind, default, *((values[path],) if values else ()), description)
    console.print(table)


def _get_path(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


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
    from detectors.series import SeriesError, read_series, score_frame

    try:
        cols = [c.strip() for c in value_columns.split(",")] if value_columns else None
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


def _detect_run(run: Path, sensitivity: float) -> None:
    from detectors.engine import EngineConfig
    from detectors.live import LiveDetection

    _readable_store(run)
    try:
        steps = load_steps(run)
        config = EngineConfig(sensitivity=sensitivity)
    except (FileNotFoundError, ValueError) as err:
        fail(str(err))
    except (sqlite3.DatabaseError, pd.errors.DatabaseError) as err:
        # corrupt, truncated, or a SQLite file that is not a meshscope run store
        fail(f"{store_path(run)}: not a readable meshscope run store ({err})")
    run_id = str(steps["run_id"].iloc[0]) if not steps.empty else run.name
    episodes = LiveDetection(run, run_id, config).stop()  # one pass; events into the store
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
    console.print(f"{len(episodes)} anomaly episode(s) written to {store_path(run)}")


def _readable_store(run: Path) -> None:
    """Exit 2 with the reason when `run` holds no readable meshscope run store."""
    from collector.store import StoreError, check_store

    try:
        check_store(run)
    except FileNotFoundError:
        fail(f"{run}: no run store ({store_path(run).name}) there")
    except StoreError as err:
        fail(str(err))


@app.command("hang-report")
def hang_report(
    run: Path | None = typer.Option(None, "--run", help="a meshscope run directory"),
    flight_recorder: Path | None = typer.Option(
        None,
        "--flight-recorder",
        help="a folder of PyTorch Flight Recorder dumps (<prefix><rank>) of a job that did not run meshscope",
    ),
    prefix: str | None = typer.Option(None, help="Flight Recorder dump names: <prefix><rank>"),
) -> None:
    """The last hang diagnosis of a run (else one from its flight logs), or a diagnosis of a
    plain job's PyTorch Flight Recorder dumps."""
    from detectors.hang import diagnose_folder

    if (run is None) == (flight_recorder is None):
        fail("give either --run DIR or --flight-recorder DIR")
    if flight_recorder is not None:
        from detectors.flight_recorder import DumpError, diagnose_dumps

        try:
            diag = diagnose_dumps(flight_recorder, prefix)
        except (DumpError, OSError) as err:
            fail(str(err))
        _print_hang(diag.detail(), f"Flight Recorder dumps in {flight_recorder}")
        return
    from collector.store import StoreError, check_store

    try:
        check_store(run)
        events = load_events(run, kind="hang")
    except FileNotFoundError:
        events = None  # no store (yet): the flight logs may still tell
    except StoreError as err:
        fail(str(err))
    except (sqlite3.DatabaseError, pd.errors.DatabaseError) as err:
        fail(f"{store_path(run)}: not a readable meshscope run store ({err})")
    if events is not None and not events.empty:
        detail, source = events.iloc[-1]["detail"], f"hang event in {store_path(run)}"
    else:
        diag = diagnose_folder(run / "live")
        if diag is None:
            fail(f"{run}: no hang event and no flight logs in {run / 'live'}")
        detail, source = diag.detail(), f"flight logs in {run / 'live'} (post-mortem)"
    _print_hang(detail, source)


def _print_hang(detail: dict, source: str) -> None:
    table = Table(title=f"hang diagnosis ({source})", show_header=False)
    for key in ("type", "culprit_ranks", "op", "seq", "group", "waiting_ranks", "why", "action"):
        if detail.get(key) is not None:
            table.add_row(key, str(detail[key]))
    console.print(table)
    for rank, stack in sorted((detail.get("stacks") or {}).items()):
        console.print(f"[bold]rank {rank}[/] (innermost last)")
        for line in stack[-8:]:
            console.print(f"    {line}", markup=False, highlight=False)


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

    from detectors.rootcause import explain as rank_causes

    _readable_store(run)
    try:
        causes = rank_causes(run, anomaly)
    except KeyError as err:
        fail(str(err.args[0]))
    except (sqlite3.DatabaseError, pd.errors.DatabaseError) as err:
        fail(f"{store_path(run)}: not a readable meshscope run store ({err})")
    if as_json:
        print(json.dumps([c.as_dict() for c in causes[:limit]], indent=1))
        return
    if not causes:
        console.print(f"{run}: nothing to explain (no anomaly, hang, NaN or death recorded)")
        return
    for i, c in enumerate(causes[:limit], 1):
        console.print(f"[bold]{i}. {c.kind}[/] ({c.confidence:.0%}) {c.title}", markup=True, highlight=False)
        for line in c.evidence:
            console.print(f"     - {line}", markup=False, highlight=False)
        console.print(f"     next: {c.action}", markup=False, highlight=False)


@app.command()
def replay(
    snapshot: Path = typer.Argument(..., help="a snapshot (.json or .safetensors) a run wrote"),
    config: Path | None = typer.Option(
        None, "--config", "-c", help="the run's config (default: config.json of the run the snapshot is in)"
    ),
) -> None:
    """Re-run a snapshot's module on the CPU; exit 0 when the non-finite value comes back."""
    from tracer.replay import replay as replay_module
    from tracer.snapshot import SnapshotError, load_snapshot
    from trainer.model import MoELM

    try:
        snap = load_snapshot(snapshot)
        cfg = load_config(config or _run_config_of(snapshot))
        try:
            module = MoELM(cfg.model).get_submodule(snap.meta.module)
        except AttributeError:
            raise SnapshotError(f"{snapshot}: the run's model has no module {snap.meta.module!r}") from None
        result = replay_module(snap, module)
    except (SnapshotError, ConfigError) as err:
        fail(str(err))
    console.print(
        f"{snap.meta.module} ({snap.meta.module_class}), {snap.meta.where}, step "
        f"{snap.meta.step}, rank {snap.meta.rank}: {result.message}"
    )
    if result.nonfinite:
        console.print("non-finite: " + ", ".join(result.nonfinite))
    raise typer.Exit(0 if result.reproduced else 1)


def _run_config_of(snapshot: Path) -> Path:
    """`runs/<id>/snapshots/<name>.json` -> `runs/<id>/config.json`."""
    path = Path(snapshot).resolve().parent.parent / "config.json"
    if not path.exists():
        raise ConfigError(f"{snapshot}: no run config at {path}; give --config")
    return path


@app.command()
def rendezvous(
    port: int = typer.Option(29400, help="port of the c10d rendezvous store"),
    host: str = typer.Option("127.0.0.1", help="address to bind"),
) -> None:
    """Host a c10d rendezvous store apart from the agents, so a job survives losing any agent."""
    launcher.host_rendezvous(host, port)


stack_app = typer.Typer(no_args_is_help=True, help="Prometheus + Alertmanager on 127.0.0.1.")
app.add_typer(stack_app, name="stack")
HOME_HELP = "folder for the stack's configs, data, logs and pid files"


@stack_app.command("up")
def stack_up(
    runs: Path = typer.Option(Path("runs"), help="runs folder to watch (file_sd over runs/_targets)"),
    home: Path = typer.Option(Path(".meshscope/stack"), help=HOME_HELP),
    prometheus_port: int = typer.Option(9090, help="Prometheus port"),
    alertmanager_port: int = typer.Option(9093, help="Alertmanager port"),
    scrape_interval: float = typer.Option(5.0, help="scrape and rule evaluation interval, seconds"),
    slack_webhook_file: Path | None = typer.Option(None, help="file holding the Slack webhook URL"),
    email_to: str | None = typer.Option(None, help="critical alerts also to a@x,b@y"),
    smtp: str = typer.Option("127.0.0.1:25", help="SMTP host:port"),
    smtp_from: str = typer.Option("meshscope@localhost", help="sender of alert emails"),
    smtp_user: str | None = typer.Option(None, help="SMTP login"),
    smtp_password_file: Path | None = typer.Option(None, help="file holding the SMTP password"),
    smtp_tls: bool = typer.Option(True, "--smtp-tls/--no-smtp-tls", help="require STARTTLS"),
    view_url: str = typer.Option("http://127.0.0.1:8501", help="drill-down view linked from alerts"),
    fast: bool = typer.Option(False, help="1 s alert grouping waits (tests, benchmarks)"),
) -> None:
    """Start Prometheus (rules, file_sd over the runs) and Alertmanager (Slack, email)."""
    from dashboards.alertmanager import AlertRouting
    from dashboards.stack import StackConfig, StackError, up

    try:
        routing = AlertRouting(
            slack_webhook_file=slack_webhook_file,
            email_to=email_to.split(",") if email_to else [],
            smtp_smarthost=smtp,
            smtp_from=smtp_from,
            smtp_username=smtp_user,
            smtp_password_file=smtp_password_file,
            smtp_require_tls=smtp_tls,
            view_url=view_url,
            fast=fast,
        )
        comps = up(
            StackConfig(
                runs_root=runs,
                home=home,
                prometheus_port=prometheus_port,
                alertmanager_port=alertmanager_port,
                scrape_interval_s=scrape_interval,
                routing=routing,
            )
        )
    except (ValueError, StackError) as err:
        fail(str(err))
    for c in comps:
        console.print(f"{c.name:12} {c.url}  pid {c.pid}  log {c.log}")
    if routing.slack_webhook_file is None and not routing.email_to:
        err_console.print(
            "[yellow]warning:[/] no --slack-webhook-file or --email-to: alerts are "
            "visible in Alertmanager only"
        )


@stack_app.command("down")
def stack_down(home: Path = typer.Option(Path(".meshscope/stack"), help=HOME_HELP)) -> None:
    """Stop the stack started from HOME."""
    from dashboards.stack import down

    stopped = down(home)
    console.print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")


@stack_app.command("status")
def stack_status(home: Path = typer.Option(Path(".meshscope/stack"), help=HOME_HELP)) -> None:
    """What runs where; per run, targets up and down; alerts firing. Exit 1 if a part is down."""
    import requests

    from dashboards.stack import firing_alerts, status, targets_by_run

    comps = status(home)
    if not comps:
        console.print(f"no stack started from {home}")
        raise typer.Exit(1)
    table = Table(title=f"stack in {home}")
    for col in ("component", "url", "pid", "state"):
        table.add_column(col)
    for c in comps:
        state = "ready" if c.ready else "running, not ready" if c.running else "stopped"
        table.add_row(c.name, c.url, str(c.pid), state)
    console.print(table)
    prom = next((c for c in comps if c.name == "prometheus" and c.ready), None)
    if prom is not None:
        try:
            for run_id, counts in sorted(targets_by_run(prom.url).items()):
                console.print(f"run {run_id}: {counts['up']} target(s) up, {counts['down']} down")
            for alert in firing_alerts(prom.url):
                labels = alert["labels"]
                console.print(
                    f"[red]firing[/] {labels['alertname']} run={labels.get('run', '')} "
                    f"{alert['annotations'].get('summary', '')}"
                )
        except requests.RequestException as err:
            err_console.print(f"[yellow]warning:[/] Prometheus did not answer: {err}")
    if not all(c.ready for c in comps):
        raise typer.Exit(1)


boards_app = typer.Typer(no_args_is_help=True, help="Grafana boards generated as code.")
app.add_typer(boards_app, name="dashboards")


@boards_app.command("build")
def dashboards_build(
    check: bool = typer.Option(False, help="exit 1 if the committed JSON is not up to date"),
) -> None:
    """Write the boards' JSON (dashboards/grafana/dashboards) and the compose configs
    (dashboards/compose), or check that the committed ones are current."""
    from dashboards.boards import OUT, build_all, render, write_all
    from dashboards.compose import FOLDER, compose_configs, write_compose_configs

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
    from dashboards.publish import PublishError, publish, read_token

    try:
        done = publish(url, read_token(token_file))
    except PublishError as err:
        fail(str(err), code=1)
    for board in done:
        console.print(f"{board.name:9} {board.url}  (version {board.version})")


if __name__ == "__main__":
    app()


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
    import subprocess
    import sys

    from dashboards.app.settings import ViewSettings

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
    app_py = Path(__file__).resolve().parents[1] / "dashboards" / "app" / "app.py"
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
    raise typer.Exit(subprocess.call(cmd, env={**os.environ, **settings.env()}))


feedback_app = typer.Typer(
    no_args_is_help=True, help="Serving-side expert load in, suggestions out, outcomes measured."
)
app.add_typer(feedback_app, name="feedback")


def _run_dir(run: Path) -> Path:
    _readable_store(run)
    return run


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
    from detectors.feedback import FeedbackError, ingest, knowledge_base

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
    from collector.controls import ControlError
    from detectors.feedback import FeedbackError, approve

    run = _run_dir(run)
    try:
        cid = approve(run, suggestion)
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
    from detectors.feedback import knowledge_base, settle_outcomes

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
    from detectors.feedback import Suggestion, export_placement

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
