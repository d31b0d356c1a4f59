"""`meshscope run` and `meshscope rendezvous`: train under torchrun with meshscope beside it."""

from __future__ import annotations

import math
import signal
from pathlib import Path
from typing import Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from meshscope.alerting import AlertPath, alert_path
from meshscope.cli.common import LazyModule, app, console, err_console, fail
from meshscope.cli.flags import RUN_FLAGS, with_config_flags
from meshscope.cli.settings import apply_set_options
from meshscope.collector.exporter import PortInUseError, remove_from_index
from meshscope.collector.maturity import maturity
from meshscope.collector.store import (
    StoreUnavailable,
    describe_store,
    load_events,
    load_expert_load,
    load_steps,
)
from meshscope.config import ConfigError, RunConfig, load_config

# what training needs (torch, the detectors, the watchdog), loaded when a run starts
launcher = LazyModule("meshscope.launcher")
sidecars = LazyModule("meshscope.sidecar")
report = LazyModule("meshscope.collector.report")
device = LazyModule("meshscope.trainer.device")


@app.command()
@with_config_flags(RunConfig, RUN_FLAGS)
def run(
    config: Path | None = typer.Option(None, "--config", "-c", help="TOML config file"),
    set_: list[str] | None = typer.Option(
        None,
        "--set",
        help="any config field, repeatable: PATH=VALUE, e.g. train.powersgd_rank=8 "
        "or elastic.keep=5 (every field: `meshscope config`)",
    ),
    check: bool = typer.Option(
        False,
        "--check",
        help="check everything (config, inject specs against the model, secrets, the alert "
        "route, device, ports) and start nothing",
    ),
    overrides: dict | None = None,
) -> None:
    """Train the reference MoE model under torchrun with meshscope watching."""
    try:
        cfg = load_config(config, apply_set_options(set_ or [], overrides or {}))
        alerts = alert_path(cfg)  # secrets and the alert route checked before any write
        cfg = launcher.resolve_run(cfg) if check else launcher.prepare_run(cfg)
    except (ConfigError, device.DeviceUnavailable, PortInUseError, ValueError) as err:
        fail(str(err))
    if check:
        console.print(
            f"ok: {cfg.nproc} ranks on {cfg.device} ({cfg.backend}), {cfg.train.steps} steps, "
            f"{len(cfg.inject)} injection(s); nothing started"
        )
        if warning := launcher.store_warning(cfg, create=False):
            err_console.print(f"[yellow]warning:[/] {warning}", soft_wrap=True)
        return
    zygote, sidecar = _start_beside(cfg, alerts)
    stop = StopSignal().install()
    code = _train_with_progress(cfg, stop, zygote)
    episodes = sidecar.stop()
    if stop.signum is not None:
        record_stop(cfg, stop.signum)
    sidecar.close()
    if stop.signum is not None:
        name = signal.Signals(stop.signum).name
        err_console.print(f"stopped by {name}: the workers stopped together at a step boundary")
        raise typer.Exit(128 + stop.signum)
    if code != 0:  # a dead run stays in Prometheus' index: RankDown/RecoveryFailed fire
        err_console.print(launcher.tail_log(cfg), markup=False, highlight=False)
        said = launcher.worker_errors(cfg)
        why = ("; ".join(said[:3]) + "; ") if said else ""
        fail(f"training failed (exit {code}): {why}logs in {cfg.run_dir / 'logs'}", code=1)
    remove_from_index(cfg.run_dir, cfg.run_id)
    try:
        _print_summary(cfg)
    except StoreUnavailable as err:
        err_console.print(f"[yellow]warning:[/] no summary: {err}")
    if episodes:
        console.print(
            f"{len(episodes)} anomaly episode(s): "
            + "; ".join(f"{e.type} ranks={e.ranks} steps {e.start_step}-{e.end_step}" for e in episodes)
        )


def _start_beside(cfg: RunConfig, alerts: AlertPath) -> tuple[Any, Any]:
    """The warm standby, started first so it warms up while the sidecar is readied, and the
    sidecar (detection, hang watchdog, alerts); the standby goes if the sidecar cannot start."""
    zygote = launcher.warm_standby(cfg)
    try:
        _print_header(cfg, alerts)
        sidecar = sidecars.Sidecar(cfg, alerts).start()
    except BaseException:
        if zygote is not None:
            zygote.terminate()
        raise
    if sidecar.metrics_url:
        console.print(f"  detector {sidecar.metrics_url}")
    else:
        err_console.print(f"[yellow]warning:[/] detector metrics not exported: {sidecar.export_error}")
    return zygote, sidecar


def _print_header(cfg: RunConfig, alerts: AlertPath) -> None:
    """Where this run's measurements and alerts will be."""
    console.print(
        f"run [bold]{cfg.run_id}[/]: {cfg.nproc} ranks on {cfg.device} ({cfg.backend}), "
        f"compression={cfg.train.compression}, overlap={cfg.train.overlap}"
        + (f", experts sharded over groups of {cfg.parallel.ep} ranks" if cfg.parallel.ep > 1 else "")
    )
    console.print(f"  store    {describe_store(cfg.run_dir)}")
    if warning := launcher.store_warning(cfg):
        err_console.print(f"[yellow]warning:[/] {warning}")
    console.print(
        f"  metrics  http://{cfg.monitor.metrics_host}:{cfg.monitor.metrics_port}.."
        f"{cfg.monitor.metrics_port + cfg.nproc - 1}"
        f"/metrics   (Prometheus file_sd: {cfg.run_dir / 'targets.json'})"
    )
    if alerts.alertmanager:
        console.print(f"  alerts   through Alertmanager at {alerts.alertmanager} (its receivers)")
    if alerts.ignored_channels:
        err_console.print(
            "[yellow]warning:[/] --slack-webhook-file/--email-to ignored: this run "
            "alerts through Alertmanager, which pages once; --alerts embedded "
            "sends from the run instead"
        )


class StopSignal:
    """SIGTERM or SIGINT to `meshscope run` (how Slurm and Kubernetes cancel a job): passed on
    to torchrun, which passes it to every worker; they agree on a step, checkpoint and end
    together. Nothing is left training unwatched."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.launch: launcher.Launch | None = None

    def install(self) -> StopSignal:
        """Handle both signals from now on."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signum = signum
        if self.launch is not None and self.launch.torchrun.poll() is None:
            self.launch.torchrun.send_signal(signal.SIGTERM)


def record_stop(cfg: RunConfig, signum: int) -> None:
    """A `run_end` for a stopped run, unless its workers wrote one (they may have been killed)."""
    from meshscope.collector.schema import Event
    from meshscope.collector.store import RunStore

    try:
        if not load_events(cfg.run_dir, kind="run_end").empty:
            return
    except FileNotFoundError:
        pass
    store = RunStore(cfg.run_dir)
    try:
        store.add_event(
            Event(kind="run_end", run_id=cfg.run_id, detail={"reason": signal.Signals(signum).name.lower()})
        )
    finally:
        store.close()


def _train_with_progress(cfg: RunConfig, stop: StopSignal, zygote: Any = None) -> int:
    """Start torchrun (its workers forking from `zygote` when there is one) and follow it with
    a progress bar of steps, loss, tokens/s and comm ratio."""
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

        stop.launch = launcher.launch(cfg, zygote)
        if stop.signum is not None:  # a signal before torchrun existed
            stop.launch.torchrun.send_signal(signal.SIGTERM)
        return launcher.follow(cfg, stop.launch, on_progress, on_wait=progress.console.print)


def _compression_cell(s: dict[str, float]) -> str:
    """raw / wire bytes, or why there is no ratio (one rank sends no gradients)."""
    if s["ranks"] <= 1:
        return "n/a (one rank: no gradient traffic)"
    ratio = s["compression_ratio"]
    return f"{ratio:.1f}x" if math.isfinite(ratio) else "n/a (no gradient bytes recorded)"


def _across_nodes_cell(s: dict[str, float]) -> str:
    """Bytes sent across nodes, and the inter-node hop's share of the time where it was timed."""
    cell = f"{s['inter_node_bytes_per_step'] / 1e6:.2f} MB"
    share = s["inter_node_time_share"]
    return cell + (f", {share:.0%} of communication time" if math.isfinite(share) else "")


def _exchange_cell(s: dict[str, float]) -> str:
    """Expert parallelism's all-to-all: time, bytes, and its share of the step."""
    return (
        f"{s['a2a_s_per_step'] * 1e3:.1f} ms, {s['a2a_bytes_per_step'] / 1e6:.2f} MB, "
        f"{s['a2a_step_share']:.0%} of the step"
    )


def _print_summary(cfg: RunConfig) -> None:
    """The finished run in one table."""
    steps, events = load_steps(cfg.run_dir), load_events(cfg.run_dir)
    s = report.summarize(steps, load_expert_load(cfg.run_dir))
    kinds = events["kind"].value_counts()
    table = Table(title=f"run {cfg.run_id}", show_header=False)
    rows = [
        ("steps x ranks", f"{s['steps']:.0f} x {s['ranks']:.0f}"),
        ("throughput", f"{s['tokens_per_s']:,.0f} tokens/s"),
        ("step time mean / p99", f"{s['step_s_mean'] * 1e3:.1f} / {s['step_s_p99'] * 1e3:.1f} ms"),
        ("comm overhead (exposed)", f"{s['comm_overhead']:.1%}"),
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
    if "inter_node_bytes_per_step" in s:
        rows.insert(5, ("across nodes (per rank and step)", _across_nodes_cell(s)))
    if "a2a_s_per_step" in s:
        rows.insert(4, ("expert all-to-all (per rank and step)", _exchange_cell(s)))
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    efficiency = report.efficiency(cfg.run_dir, steps, events)
    console.print(f"where the time went: {efficiency['account'].text()}", soft_wrap=True, highlight=False)
    console.print(
        f"training efficiency index: {report.efficiency_text(efficiency)}", soft_wrap=True, highlight=False
    )
    level = maturity(cfg.run_dir, steps, events)
    console.print(f"maturity: {level.text()}", soft_wrap=True, highlight=False)
    console.print(f"store: {describe_store(cfg.run_dir)}")
    host = report.busiest_host(events)
    if host is not None and host.oversubscribed:
        console.print(f"[yellow]host:[/] {host.describe()}")


@app.command()
def rendezvous(
    port: int = typer.Option(29400, help="port of the c10d rendezvous store"),
    host: str = typer.Option("127.0.0.1", help="address to bind"),
) -> None:
    """Host a c10d rendezvous store apart from the agents, so a job survives losing any agent."""
    launcher.host_rendezvous(host, port)
