"""`meshscope stack up|down|status`: Prometheus and Alertmanager on this machine."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from meshscope.alerts.config import AlertRouting
from meshscope.cli.common import app, console, err_console, fail

stack_app = typer.Typer(
    no_args_is_help=True,
    help="Prometheus + Alertmanager on 127.0.0.1 (VictoriaMetrics and a PostgreSQL job store on request).",
)


app.add_typer(stack_app, name="stack")


HOME_HELP = "folder for the stack's configs, data, logs and pid files"
STORE_HOST_HELP = (
    "address the job store listens on and runs are given (with --store; default: this node's "
    "address on its default route, which the other nodes reach; 127.0.0.1 keeps it here)"
)
STORE_TLS_HELP = "CERT,KEY: the job store serves TLS with them; other nodes log in over TLS only"
STORE_ALLOW_HELP = (
    "networks (CIDR, comma-separated) whose nodes may log in with the password (with --store; "
    "default: the network of the default route's interface)"
)


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
    fast: bool = typer.Option(False, help="1 s alert grouping waits, fresh samples at once (tests)"),
    remote_write: bool = typer.Option(False, "--remote-write/--no-remote-write", help="also VictoriaMetrics"),
    victoria_port: int = typer.Option(8428, help="VictoriaMetrics port (with --remote-write)"),
    store: bool = typer.Option(False, "--store/--no-store", help="also a PostgreSQL job store (run --store)"),
    store_port: int = typer.Option(5433, help="PostgreSQL port (with --store)"),
    store_host: str = typer.Option("", help=STORE_HOST_HELP),
    store_allow: str = typer.Option("", help=STORE_ALLOW_HELP),
    store_tls: str = typer.Option("", help=STORE_TLS_HELP),
) -> None:
    """Start Prometheus (rules, file_sd over the runs) and Alertmanager (Slack, email)."""
    from meshscope.dashboards.stack import StackConfig, StackError, up

    listen, allow = _store_network(store_host, store_allow)
    try:
        routing = AlertRouting(
            slack_webhook_file=slack_webhook_file,
            email_to=email_to.split(",") if email_to else [],
            smtp=smtp,
            smtp_from=smtp_from,
            smtp_user=smtp_user,
            smtp_password_file=smtp_password_file,
            smtp_tls=smtp_tls,
            view_url=view_url,
        )
        comps = up(
            StackConfig(
                runs_root=runs,
                home=home,
                prometheus_port=prometheus_port,
                alertmanager_port=alertmanager_port,
                scrape_interval_s=scrape_interval,
                routing=routing,
                fast=fast,
                remote_write=remote_write,
                victoria_port=victoria_port,
                store=store,
                store_port=store_port,
                store_listen=listen,
                store_allow=allow,
                store_tls=_tls_files(store_tls),
            )
        )
    except (ValueError, StackError) as err:
        fail(str(err))
    _print_components(comps, home, routing)


def _tls_files(value: str) -> tuple[Path, Path] | None:
    """--store-tls CERT,KEY as two readable files (None without it)."""
    if not value:
        return None
    parts = [Path(p.strip()).expanduser().resolve() for p in value.split(",")]
    if len(parts) != 2:
        fail(f"--store-tls {value!r}: give CERT,KEY (two files)")
    for path in parts:
        try:
            path.read_bytes()
        except OSError as err:
            fail(f"--store-tls: {path} is not a readable file ({err.strerror})")
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
        fail(f"--store-host/--store-allow: {err}")
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
def stack_down(home: Path = typer.Option(Path(".meshscope/stack"), help=HOME_HELP)) -> None:
    """Stop the stack started from HOME."""
    from meshscope.dashboards.stack import down

    stopped = down(home)
    console.print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")


@stack_app.command("status")
def stack_status(home: Path = typer.Option(Path(".meshscope/stack"), help=HOME_HELP)) -> None:
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
