"""`meshscope stack up|down|status`: Prometheus and Alertmanager on this machine."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from meshscope.alerts.config import AlertRouting
from meshscope.cli.common import app, console, err_console, fail
from meshscope.cli.flags import ALERT_FLAGS, with_config_flags
from meshscope.config import ConfigError, RunConfig, load_config
from meshscope.dashboards.stack_config import STACK_HOME, StackSettings

stack_app = typer.Typer(
    no_args_is_help=True,
    help="Prometheus + Alertmanager on 127.0.0.1 (VictoriaMetrics and a PostgreSQL job store on request).",
)


app.add_typer(stack_app, name="stack")


# flag -> config path (`meshscope config`: the `stack`, `alerts` and `runs_root` fields)
STACK_FLAGS: dict[str, str] = {
    "runs": "runs_root",
    "home": "stack.home",
    "prometheus-port": "stack.prometheus_port",
    "alertmanager-port": "stack.alertmanager_port",
    "scrape-interval": "stack.scrape_interval_s",
    **ALERT_FLAGS,
    "fast": "stack.fast",
    "remote-write": "stack.remote_write",
    "victoria-port": "stack.victoria_port",
    "store": "stack.job_store",
    "store-port": "stack.job_store_port",
    "store-host": "stack.job_store_host",
    "store-allow": "stack.job_store_allow",
    "store-tls": "stack.job_store_tls",
}
HOME = typer.Option(STACK_HOME, help=StackSettings.model_fields["home"].description)


@stack_app.command("up")
@with_config_flags(RunConfig, STACK_FLAGS)
def stack_up(
    config: Path | None = typer.Option(
        None, "--config", "-c", help="TOML whose stack and alerts sections and runs_root apply (flags win)"
    ),
    overrides: dict[str, Any] | None = None,
) -> None:
    """Start Prometheus (rules, file_sd over the runs) and Alertmanager (Slack, email)."""
    from meshscope.dashboards.stack import StackConfig, StackError, up

    try:
        cfg = load_config(config, overrides)
    except ConfigError as err:
        fail(str(err))
    stack = cfg.stack
    listen, allow = _store_network(stack.job_store_host, stack.job_store_allow)
    routing = AlertRouting(**cfg.alerts.model_dump(include=set(AlertRouting.model_fields)))
    try:
        comps = up(
            StackConfig(
                **stack.model_dump(),
                runs_root=cfg.runs_root,
                routing=routing,
                store_listen=listen,
                store_allow=allow,
                store_tls=_tls_files(stack.job_store_tls),
            )
        )
    except (ValueError, StackError) as err:
        fail(str(err))
    _print_components(comps, stack.home, routing)


def _tls_files(value: str) -> tuple[Path, Path] | None:
    """--store-tls CERT,KEY as two readable files (None without it)."""
    if not value:
        return None
    parts = [Path(p.strip()).expanduser().resolve() for p in value.split(",")]
    if len(parts) != 2:
        fail(f"stack.job_store_tls (--store-tls) {value!r}: give CERT,KEY (two files)")
    for path in parts:
        try:
            path.read_bytes()
        except OSError as err:
            fail(f"stack.job_store_tls (--store-tls): {path} is not a readable file ({err.strerror})")
    return parts[0], parts[1]


def _store_network(host: str, allow: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Where the job store listens (the address given to runs first, loopback too) and which
    networks may log in: another node must reach it, or `run --store` there is refused."""
    import ipaddress

    from meshscope.trainer.network import node_network

    address, network = node_network() if not host else (host, "")
    try:
        wanted = [n.strip() for n in allow.split(",") if n.strip()]
        nets = tuple(str(ipaddress.ip_network(n, strict=False)) for n in wanted)
        ipaddress.ip_address(address)
    except ValueError as err:
        fail(f"stack.job_store_host/job_store_allow (--store-host/--store-allow): {err}")
    if address.startswith("127."):
        err_console.print("note: the job store listens on this machine only (--store-host ADDR for others)")
        return (address,), nets
    return (address, "127.0.0.1"), nets or ((network,) if network else (f"{address}/32",))


def _print_components(comps: list, home: Path, routing: Any) -> None:
    """What runs where, the flags a run needs to write to the job store, where alerts go."""
    for c in comps:
        console.print(f"{c.name:16} {c.url}  pid {c.pid}  log {c.log}", soft_wrap=True)
        if c.name == "postgres":  # one line a user (or a script) copies as it is
            password = home.resolve() / "postgres" / "password"  # pasted on another node as it is
            flags = f"--store {shlex.quote(c.url)} --store-password-file {shlex.quote(str(password))}"
            console.print(f"  runs write to it with: {flags}", soft_wrap=True, markup=False, highlight=False)
    if routing.slack_webhook_file is None and not routing.email_to:
        err_console.print(
            "[yellow]warning:[/] no --slack-webhook-file or --email-to: alerts are "
            "visible in Alertmanager only"
        )


@stack_app.command("down")
def stack_down(home: Path = HOME) -> None:
    """Stop the stack started from HOME."""
    from meshscope.dashboards.stack import down

    stopped = down(home)
    console.print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")


@stack_app.command("status")
def stack_status(home: Path = HOME) -> None:
    """What runs where; per run, targets up and down; alerts firing. Exit 1 if a part is down."""
    import requests

    from meshscope.dashboards.stack import firing_alerts, status, targets_by_run

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
