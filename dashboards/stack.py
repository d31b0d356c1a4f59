"""`meshscope stack`: Prometheus and Alertmanager from the installed binaries, on 127.0.0.1,
pointed at a runs folder, with their configs, data, logs and pid files under one folder of ours;
on request VictoriaMetrics (Prometheus remote-writes every sample to it: long retention and
cluster-wide queries) and PostgreSQL (the job store of multi-node runs).

The processes outlive the command that started them (their own session); `down` stops them
through the pid files, and a pid is only trusted while its command line is still that binary.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from meshscope.alerts.config import AlertRouting
from meshscope.collector.exporter import TARGETS_INDEX
from meshscope.dashboards.alertmanager import checked, write_alertmanager_config
from meshscope.dashboards.prometheus import write_prometheus_config, write_rules
from meshscope.dashboards.stack_config import StackSettings

BINARIES = {
    "prometheus": ("prometheus",),
    "alertmanager": ("prometheus-alertmanager", "alertmanager"),
    "victoria-metrics": ("victoria-metrics", "victoria-metrics-prod"),
}  # Debian's name, upstream's
INSTALL_HINT = (
    "apt-get install prometheus prometheus-alertmanager victoria-metrics (Debian), or put them on PATH"
)
VM_RETENTION = "12"  # months of samples VictoriaMetrics keeps


class StackError(RuntimeError):
    """The stack could not be started or reached; the message says which part and why."""


class StackConfig(StackSettings):
    """One `meshscope stack`: its settings, the runs folder it watches, where alerts go, and
    the job store's network resolved (servers on 127.0.0.1, the job store where asked)."""

    runs_root: Path
    routing: AlertRouting = Field(default_factory=AlertRouting)
    store_listen: tuple[str, ...] = ("127.0.0.1",)  # the first is the address runs are given
    store_allow: tuple[str, ...] = ()  # networks (CIDR) whose nodes log in with the password
    store_tls: tuple[Path, Path] | None = None  # (certificate, key): the job store serves TLS

    def model_post_init(self, _context: object) -> None:
        """A bad relay or a missing secret fails before anything starts."""
        checked(self.routing)


@dataclass
class Component:
    """One server the stack started, to report and to stop."""

    name: str
    pid: int
    port: int
    url: str
    log: str
    running: bool = False
    ready: bool = False


def find_binary(component: str) -> str:
    """The installed binary of a stack component; StackError naming the package."""
    for name in BINARIES[component]:
        path = shutil.which(name)
        if path:
            return path
    raise StackError(f"{component}: none of {', '.join(BINARIES[component])} is installed; {INSTALL_HINT}")


def _commands(cfg: StackConfig) -> dict[str, list[str]]:
    home = cfg.home.resolve()
    am = f"127.0.0.1:{cfg.alertmanager_port}"
    rules = write_rules(home / "rules.yml")
    prom_config = write_prometheus_config(
        home / "prometheus.yml",
        cfg.runs_root,
        scrape_interval_s=cfg.scrape_interval_s,
        rule_files=[str(rules)],
        alertmanager=am,
        remote_write=f"http://127.0.0.1:{cfg.victoria_port}/api/v1/write" if cfg.remote_write else None,
    )
    am_config = write_alertmanager_config(home / "alertmanager", cfg.routing, fast=cfg.fast)
    commands = {
        "prometheus": [
            find_binary("prometheus"),
            f"--config.file={prom_config}",
            f"--storage.tsdb.path={home / 'prometheus-data'}",
            f"--web.listen-address=127.0.0.1:{cfg.prometheus_port}",
            "--web.enable-lifecycle",
        ],
        "alertmanager": [
            find_binary("alertmanager"),
            f"--config.file={am_config}",
            f"--storage.path={home / 'alertmanager-data'}",
            f"--web.listen-address={am}",
            "--cluster.listen-address=",
        ],  # no gossip port on 0.0.0.0:9094
    }
    if cfg.remote_write:
        commands["victoria-metrics"] = [
            find_binary("victoria-metrics"),
            f"-httpListenAddr=127.0.0.1:{cfg.victoria_port}",
            f"-storageDataPath={home / 'victoria-metrics-data'}",
            f"-retentionPeriod={VM_RETENTION}",
            # by default samples younger than 30 s are not served (they may still change)
            *(["-search.latencyOffset=1s", "-search.disableCache"] if cfg.fast else []),
        ]
    return commands


def _ensure_free(name: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as err:
            raise StackError(
                f"cannot start {name}: port {port} on 127.0.0.1 is already in use "
                f"({err.strerror}); choose another with --{name}-port"
            ) from None


def _http(
    url: str, *, method: str = "GET", params: dict[str, str] | None = None, timeout: float = 5
) -> bytes:
    """One HTTP call to a local part, with the standard library: the CLI needs no extra."""
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=timeout) as r:
        return r.read()


def _ready(url: str) -> bool:
    if url.startswith("postgresql://"):  # the job store: it accepts connections
        parts = urllib.parse.urlsplit(url)
        try:
            socket.create_connection((parts.hostname, parts.port), timeout=1).close()
            return True
        except OSError:
            return False
    try:
        _http(f"{url}/-/ready", timeout=1)
        return True
    except OSError:  # refused, timed out, or not 2xx (HTTPError is an OSError too)
        return False


def _alive(pid: int, binary: str) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return False
    return Path(cmdline).name == Path(binary).name


def status(home: Path) -> list[Component]:
    """What runs where, from the pid files; `running` and `ready` checked now."""
    out = []
    for pid_file in sorted(Path(home).glob("*.json")):
        info = json.loads(pid_file.read_text())
        comp = Component(**{k: info[k] for k in ("name", "pid", "port", "url", "log")})
        comp.running = _alive(comp.pid, info["binary"])
        comp.ready = comp.running and _ready(comp.url)
        out.append(comp)
    return out


def up(cfg: StackConfig, timeout_s: float = 30.0) -> list[Component]:
    """Start what is not already running; wait until both answer /-/ready."""
    cfg.home.mkdir(parents=True, exist_ok=True)
    (cfg.home / "logs").mkdir(exist_ok=True)
    (cfg.runs_root / TARGETS_INDEX).mkdir(parents=True, exist_ok=True)  # file_sd watches it
    before = status(cfg.home)
    ports = {"prometheus": cfg.prometheus_port, "alertmanager": cfg.alertmanager_port}
    if cfg.remote_write:
        ports["victoria-metrics"] = cfg.victoria_port
    todo = [name for name in ports if name not in {c.name for c in before if c.running}]
    commands = _commands(cfg)  # finds the binaries first; rewrites the configs (reloaded below)
    for name in todo:
        _ensure_free(name, ports[name])
    for comp in before:
        if comp.ready:
            try:
                _http(f"{comp.url}/-/reload", method="POST")
            except OSError as err:
                raise StackError(
                    f"{comp.name} at {comp.url} did not reload its rewritten "
                    f"configuration ({err}); see {cfg.home / 'logs'}"
                ) from None
    started = {name: _launch(cfg, name, commands[name], ports[name]) for name in todo}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, proc in started.items():
            if proc.poll() is not None:  # ours: its exit status is the truth, not /proc
                tail = (cfg.home / "logs" / f"{name}.log").read_text(errors="replace")[-1500:]
                down(cfg.home)
                raise StackError(f"{name} exited at start (status {proc.returncode}); its log ends:\n{tail}")
        comps = status(cfg.home)
        if all(c.ready for c in comps):
            if cfg.job_store:
                comps.append(_start_store(cfg))
            _record_runs_root(cfg.home, cfg.runs_root)
            return comps
        time.sleep(0.1)
    down(cfg.home)
    raise StackError(f"the stack was not ready within {timeout_s:.0f} s; logs in {cfg.home / 'logs'}")


def _launch(cfg: StackConfig, name: str, command: list[str], port: int) -> subprocess.Popen:
    """Start one component in a session of its own (it outlives us) and write its pid file."""
    log = cfg.home / "logs" / f"{name}.log"
    with open(log, "ab") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    info = {"name": name, "pid": proc.pid, "port": port, "binary": command[0]}
    info |= {"url": f"http://127.0.0.1:{port}", "log": str(log), "cmd": command}
    (cfg.home / f"{name}.json").write_text(json.dumps(info))
    return proc


def _start_store(cfg: StackConfig) -> Component:
    """The job store: a local PostgreSQL (started once; `down` stops it)."""
    from meshscope.dashboards import postgres

    home = cfg.home.resolve() / "postgres"
    running = next((c for c in status(cfg.home) if c.name == "postgres" and c.running), None)
    if running is not None:
        return running
    _ensure_free("store", cfg.job_store_port)
    try:
        server = postgres.start(
            home, cfg.job_store_port, listen=cfg.store_listen, allow=cfg.store_allow, tls=cfg.store_tls
        )
    except postgres.PostgresError as err:
        raise StackError(f"job store: {err}") from None
    pid = int((server.data / "postmaster.pid").read_text().split()[0])
    log = str(home / "postgres.log")
    info = {
        "name": "postgres",
        "pid": pid,
        "port": cfg.job_store_port,
        "binary": "postgres",
        "url": server.url,
    }
    info |= {"log": log, "password_file": str(server.password_file), "stop_signal": int(signal.SIGINT)}
    (cfg.home / "postgres.json").write_text(json.dumps(info))  # SIGINT: PostgreSQL's fast shutdown
    return Component("postgres", pid, cfg.job_store_port, server.url, log, running=True, ready=True)


def _record_runs_root(home: Path, runs_root: Path) -> None:
    """Say in each pid file which runs folder this stack's Prometheus watches."""
    for pid_file in Path(home).glob("*.json"):
        info = json.loads(pid_file.read_text())
        info["runs_root"] = str(Path(runs_root).resolve())
        pid_file.write_text(json.dumps(info))


def alerting_for(home: Path, runs_root: Path) -> str | None:
    """The Alertmanager URL when a stack started from `home` is up and its Prometheus watches
    `runs_root` (so a run there alerts through it); None otherwise."""
    try:
        comps = {c.name: c for c in status(home)}
        infos = [json.loads(p.read_text()) for p in Path(home).glob("*.json")]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    watched = {i.get("runs_root") for i in infos}
    if watched != {str(Path(runs_root).resolve())}:
        return None
    prom, am = comps.get("prometheus"), comps.get("alertmanager")
    return am.url if prom and am and prom.ready and am.ready else None


def down(home: Path, timeout_s: float = 10.0) -> list[str]:
    """Stop every component started from `home`; returns the names stopped."""
    stopped = []
    for pid_file in sorted(Path(home).glob("*.json")):
        info = json.loads(pid_file.read_text())
        if _alive(info["pid"], info["binary"]):
            os.kill(info["pid"], info.get("stop_signal", signal.SIGTERM))
            deadline = time.monotonic() + timeout_s
            while _alive(info["pid"], info["binary"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(info["pid"], info["binary"]):
                os.kill(info["pid"], signal.SIGKILL)
            stopped.append(info["name"])
        pid_file.unlink()
    return stopped


def targets_by_run(prometheus_url: str) -> dict[str, dict[str, int]]:
    """Per run: how many of its scrape targets are up and down (what `status` reports)."""
    active = json.loads(_http(f"{prometheus_url}/api/v1/targets", params={"state": "active"}))["data"][
        "activeTargets"
    ]
    out: dict[str, dict[str, int]] = {}
    for t in active:
        run = t["labels"].get("run", "?")
        counts = out.setdefault(run, {"up": 0, "down": 0})
        counts["up" if t["health"] == "up" else "down"] += 1
    return out


def firing_alerts(prometheus_url: str) -> list[dict[str, Any]]:
    """The alerts Prometheus is firing now."""
    alerts = json.loads(_http(f"{prometheus_url}/api/v1/alerts"))["data"]["alerts"]
    return [a for a in alerts if a["state"] == "firing"]
