"""Launch the reference trainer under torchrun and follow it through the run store."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from meshscope import waiting
from meshscope.collector.exporter import ensure_ports_free
from meshscope.collector.flightread import latest_logs
from meshscope.collector.store import StoreUnavailable, latest_step, load_steps
from meshscope.collector.storedb import pg_connect, write_locator
from meshscope.config import RunConfig
from meshscope.trainer.device import backend_environment, check_placement, resolve_device
from meshscope.trainer.forksafe import die_with_parent
from meshscope.trainer.network import Route, network_environment, node_route, rendezvous_host
from meshscope.trainer.spawn import ZYGOTE_ENV, ZYGOTE_PID_ENV

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKER_ENTRY = "meshscope.worker"  # the trainer with the tracer wired in


def new_run_id() -> str:
    """A run id that sorts by time: UTC timestamp and pid."""
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-") + f"{os.getpid() % 10000:04d}"


def prepare_run(cfg: RunConfig) -> RunConfig:
    """Check device and ports, create the run directory, write the resolved config.

    Raises DeviceUnavailable or PortInUseError with a message for the user.
    """
    cfg = resolve_run(cfg)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    (cfg.run_dir / "logs").mkdir(exist_ok=True)
    (cfg.run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    if cfg.store:  # every reader of this run directory finds the job store through it
        write_locator(cfg.run_dir, cfg.store_target)
    # Agents sharing a run directory (elastic membership) differ in ports: each its own copy.
    agent_config(cfg).parent.mkdir(exist_ok=True)
    agent_config(cfg).write_text(cfg.model_dump_json(indent=2))
    return cfg


def resolve_run(cfg: RunConfig) -> RunConfig:
    """The config as the run will use it (device, address, id chosen), every check that needs
    the machine done (device, placement, ports), and nothing written: `run --check` stops here."""
    device = resolve_device(cfg.device, backend=cfg.backend)
    check_placement(device.kind, device.backend, cfg.nproc)
    # Workers and the summary see what was chosen, not "auto".
    cfg = cfg.model_copy(update={"device": device.kind, "backend": device.backend})
    if cfg.multi_node and not cfg.elastic.rdzv_endpoint:
        raise ValueError(
            f"elastic.nnodes {cfg.elastic.nnodes}: the agents of several nodes meet at one rendezvous: "
            "--rdzv-endpoint HOST:PORT, the same on every node (one node's address, or a "
            "`meshscope rendezvous` server's)"
        )
    if cfg.multi_node and not (cfg.run_id or cfg.elastic.rdzv_id):
        raise ValueError(
            "a run on several nodes needs one id shared by its agents: --run-id ID, the same on "
            "every node (a per-agent timestamp would make each agent a job of its own)"
        )
    if not cfg.monitor.metrics_host:
        monitor = cfg.monitor.model_copy(update={"metrics_host": route(cfg).address})
        cfg = cfg.model_copy(update={"monitor": monitor})
    ensure_ports_free(cfg.monitor.metrics_host, [cfg.monitor.metrics_port + r for r in range(cfg.nproc)])
    if not cfg.run_id:
        cfg = cfg.model_copy(update={"run_id": cfg.elastic.rdzv_id or new_run_id()})
    return cfg.model_copy(update={"runs_root": cfg.runs_root.resolve()})


def store_warning(cfg: RunConfig, *, create: bool = True) -> str | None:
    """Why this run's store will not show the whole job, or is not there yet (None: fine).
    The job store is created here, once, before any rank writes (`create`; `run --check` only
    logs in); a server that does not answer is a warning, not an error: the node's rows wait on
    its disk until it does."""
    if not cfg.store:
        if cfg.multi_node:
            return (
                "a job on several nodes without --store: this node's store holds its own ranks only, "
                "so detection, explain and the view see this node alone "
                "(--store postgresql://... gives the job one store)"
            )
        return None
    try:
        pg_connect(cfg.store_target, create=create).close()
    except StoreUnavailable as err:
        return f"{err}: this node's rows wait in its run folder until it answers"
    return None


def route(cfg: RunConfig) -> Route:
    """Loopback on one node; the route to the rendezvous host on several (`trainer.network`)."""
    return node_route(cfg.multi_node, cfg.elastic.rdzv_endpoint)


def hosts_rendezvous(cfg: RunConfig) -> bool:
    """Whether this agent must be told to host the rendezvous store: torchrun guesses it from
    the machine's hostname (and, guessing, falls back to a client when another agent of the
    machine hosts it), which misses an endpoint on an address of ours the hostname does not
    name (a second interface, a network namespace). Told, it never falls back, so only then."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    host = rendezvous_host(cfg.elastic.rdzv_endpoint or "127.0.0.1:29400")
    if _matches_machine_hostname(host):
        return False
    return route(cfg).address == socket.gethostbyname(host)


def agent_config(cfg: RunConfig) -> Path:
    """Where this agent writes the config its workers read."""
    return cfg.run_dir / "agents" / f"{os.getpid()}.json"


def torchrun_command(cfg: RunConfig, warm: bool) -> list[str]:
    """torchrun: standalone for one agent; c10d rendezvous when agents join (--nnodes MIN:MAX)."""
    e = cfg.elastic
    if e.nnodes == "1" and not e.rdzv_endpoint:
        topology = ["--standalone"]
    else:
        topology = [
            f"--nnodes={e.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={e.rdzv_endpoint or '127.0.0.1:29400'}",
            f"--rdzv-id={e.rdzv_id or cfg.run_id}",
            # the address peers dial for this agent's workers: the one on the route to them
            f"--local-addr={route(cfg).address}",
        ]
        # a dead agent is noticed after 3 missed 1 s keep-alives (torch default: 3 x 5 s)
        conf = [
            f"last_call_timeout={e.last_call_s:g}",
            "keep_alive_interval=1",
            "keep_alive_max_attempt=3",
        ]
        if e.rdzv_external:
            conf.append("is_host=false")
        elif hosts_rendezvous(cfg):
            conf.append("is_host=true")
        topology.append(f"--rdzv-conf={','.join(conf)}")
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *topology,
        f"--nproc-per-node={cfg.nproc}",
        f"--max-restarts={e.max_restarts}",
        "--log-dir",
        str(cfg.run_dir / "logs" / "torchrun"),
        "--redirects",
        "3",
        "-m",
        "meshscope.trainer.spawn" if warm else WORKER_ENTRY,
        "--config",
        str(agent_config(cfg)),
    ]


def worker_environment(cfg: RunConfig) -> dict[str, str]:
    """The workers' environment: the user's, plus what the device and meshscope need."""
    device = resolve_device(cfg.device, backend=cfg.backend)
    env = dict(os.environ)
    if env.pop("MESHSCOPE_QUIETED_TORCH_CPP_LOG", None):  # the CLI's own, not the user's (cli.main)
        env.pop("TORCH_CPP_LOG_LEVEL", None)
    env.update(network_environment(route(cfg), os.environ))  # what the user set wins
    for key, value in backend_environment(device.kind, device.backend).items():
        env.setdefault(key, value)
    if cfg.elastic.nnodes != "1":
        # a fresh store per rendezvous round, so agents with different restart counts meet
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["MESHSCOPE_WORKER_ENTRY"] = WORKER_ENTRY  # trainer.worker.ENTRY_ENV: zygote, fallback
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    return env


def zygote_socket() -> Path:
    """The warm standby's socket for this agent."""
    return Path(tempfile.gettempdir()) / f"meshscope-zygote-{os.getpid()}.sock"


def start_zygote(cfg: RunConfig, env: dict[str, str]) -> subprocess.Popen:
    """The warm standby (trainer.zygote), started and not waited for: it warms up while
    torchrun starts, and its clients (trainer.spawn) wait for its socket."""
    zygote_socket().unlink(missing_ok=True)
    log = open(zygote_log(cfg), "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "meshscope.trainer.zygote", "--socket", str(zygote_socket())],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO_ROOT,
        preexec_fn=die_with_parent,  # a killed CLI takes its standby with it
    )


def zygote_log(cfg: RunConfig) -> Path:
    """The warm standby's output for this agent."""
    return cfg.run_dir / "logs" / f"zygote-{os.getpid()}.log"


def zygote_refusal(cfg: RunConfig, code: int) -> str:
    """Why a warm standby ended without serving (its own words where it gave them): the
    workers then started plainly (trainer.spawn falls back), which the user hears once."""
    lines = zygote_log(cfg).read_text(errors="replace").strip().splitlines()
    last = lines[-1] if lines else f"exit {code}"
    why = next((line for line in lines if "meshscope zygote:" in line), last)
    return f"warm standby off for this run ({why}); workers start plainly"


class Launch:
    """torchrun (and the warm standby it forks workers from) for one agent."""

    def __init__(self, cfg: RunConfig, zygote: subprocess.Popen | None = None) -> None:
        """`zygote`: a warm standby started earlier (`warm_standby`), else one starts now."""
        self.cfg = cfg
        env = worker_environment(cfg)
        self.zygote = zygote or warm_standby(cfg)
        if self.zygote is not None:
            env[ZYGOTE_ENV], env[ZYGOTE_PID_ENV] = str(zygote_socket()), str(self.zygote.pid)
        log = open(cfg.run_dir / "logs" / f"launcher-{os.getpid()}.log", "wb")
        command = torchrun_command(cfg, warm=self.zygote is not None)
        # a killed CLI (SIGKILL too) sends torchrun SIGTERM, and torchrun stops its workers
        self.torchrun = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, preexec_fn=die_with_parent
        )

    def poll(self) -> int | None:
        """torchrun's exit code once it ended (then the zygote goes too), else None."""
        self._heed_zygote()
        code = self.torchrun.poll()
        if code is not None:
            self.close()
        return code

    def _heed_zygote(self) -> None:
        """One warning when the warm standby ended on its own (it refused to fork)."""
        if self.zygote is not None and (code := self.zygote.poll()) is not None:
            print(f"meshscope: warning: {zygote_refusal(self.cfg, code)}", file=sys.stderr)
            self.zygote = None

    @property
    def returncode(self) -> int | None:
        """torchrun's exit code, None while it runs."""
        return self.torchrun.returncode

    def close(self) -> None:
        """Stop the zygote (torchrun stops itself)."""
        self._heed_zygote()
        if self.zygote is not None:
            self.zygote.terminate()
            self.zygote.wait(timeout=10)
        self.zygote = None
        zygote_socket().unlink(missing_ok=True)


def warm_standby(cfg: RunConfig) -> subprocess.Popen | None:
    """The warm standby for `cfg` (None when it is off), started early: it imports torch and
    the trainer while the agent readies its sidecar, so the workers fork at once."""
    return start_zygote(cfg, worker_environment(cfg)) if cfg.elastic.warm_standby else None


def launch(cfg: RunConfig, zygote: subprocess.Popen | None = None) -> Launch:
    """Start torchrun (and the warm standby, unless `zygote` is one started already)."""
    return Launch(cfg, zygote)


def follow(
    cfg: RunConfig,
    proc: Launch,
    on_progress: Callable[[int, dict], None],
    poll_s: float = 0.5,
    on_wait: Callable[[str], None] | None = None,
) -> int:
    """Poll the store until the workers exit; report (steps done, the last record of this
    node's first rank), and, on several nodes, what the agent waits for while no step comes
    (`on_wait`, every `waiting.SAY_EVERY_S`)."""
    seen, moved, said = -1, time.monotonic(), time.monotonic()
    while True:
        done = proc.poll() is not None
        try:
            step = latest_step(cfg.run_dir, rank=None)  # the store's first rank (0 on a job store)
            rows = load_steps(cfg.run_dir, since_step=step - 1) if step > seen else None
        except StoreUnavailable:  # the job store is down: progress waits, training does not
            step, rows = seen, None
        if rows is not None:
            last = rows[rows["rank"] == rows["rank"].min()].iloc[-1].to_dict() if not rows.empty else {}
            on_progress(step + 1, last)
            seen, moved = step, time.monotonic()
        if done:
            return proc.returncode
        now = time.monotonic()
        if on_wait is not None and cfg.multi_node and min(now - moved, now - said) >= waiting.SAY_EVERY_S:
            on_wait(waiting.waiting_line(cfg, now - moved, started=seen >= 0))
            said = now
        time.sleep(poll_s)


def worker_errors(cfg: RunConfig) -> list[str]:
    """What the workers of the newest attempt said they died of (their flight logs' errors),
    by rank: the line a failed run leads with, before any log dump."""
    heads = latest_logs(cfg.run_dir / "live") if (cfg.run_dir / "live").is_dir() else {}
    return [f"rank {rank}: {head.last_error}" for rank, head in sorted(heads.items()) if head.last_error]


def tail_log(cfg: RunConfig, lines: int = 30) -> str:
    """The last lines of the workers' output, for an error message."""
    parts = []
    for path in sorted((cfg.run_dir / "logs").rglob("*.log")):
        text = path.read_text(errors="replace").strip().splitlines()
        if text:
            parts.append(f"--- {path.relative_to(cfg.run_dir)}\n" + "\n".join(text[-lines:]))
    return "\n".join(parts)


def host_rendezvous(host: str, port: int) -> None:
    """Serve a TCPStore for torchrun's c10d rendezvous until interrupted, listening on `host`
    only: the store is unauthenticated (heartbeats, verdicts, stacks), and TCPStore alone
    listens on every interface, so it is handed a socket bound where the user said."""
    import socket

    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(1024)
    fd = listener.fileno()
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=fd)
    print(
        f"rendezvous store listening on {host}:{port}; agents: --rdzv-endpoint {host}:{port} --rdzv-external",
        flush=True,
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    del store
    listener.close()
