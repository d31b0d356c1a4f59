"""The one documented place that reads torchrun's environment variables."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    """Where this process sits in the job, as torchrun describes it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    group_rank: int = 0
    restart_count: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    node: str = "localhost"
    torchrun: bool = False
    """Started by a torchrun agent (its store is there even when world_size is 1)."""
    agent_store: bool = True
    """MASTER_PORT is the agent's store, which outlives restarts (else rank 0 hosts a fresh one)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """torchrun's variables (the one place meshscope reads them)."""
        env = os.environ if environ is None else environ

        def num(name: str, default: int) -> int:
            raw = env.get(name)
            if raw is None or raw == "":
                return default
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None

        return cls(
            rank=num("RANK", 0),
            world_size=num("WORLD_SIZE", 1),
            local_rank=num("LOCAL_RANK", 0),
            local_world_size=num("LOCAL_WORLD_SIZE", 1),
            group_rank=num("GROUP_RANK", 0),
            restart_count=num("TORCHELASTIC_RESTART_COUNT", 0),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=num("MASTER_PORT", 29500),
            node=socket.gethostname(),
            torchrun="TORCHELASTIC_RUN_ID" in env,
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "True") == "True",
        )

    @property
    def ranks_per_node(self) -> int:
        """Ranks on this node: torchrun's LOCAL_WORLD_SIZE; without torchrun and without it
        set (a job started by mp.spawn), the whole world on one node."""
        if self.torchrun or self.local_world_size > 1:
            return self.local_world_size
        return self.world_size

    @property
    def is_distributed(self) -> bool:
        """More than one rank."""
        return self.world_size > 1

    def local_ranks(self) -> list[int]:
        """Global ranks of this node's workers (torchrun assigns them contiguously per node)."""
        first = self.rank - self.local_rank
        return list(range(first, first + self.local_world_size))


@dataclass(frozen=True, kw_only=True)
class HostShare:
    """How many busy threads this node's ranks bring to how many cores. Ranks that outnumber
    the cores take turns on them: their step times differ for that reason alone, which is
    the host's doing, not a slow rank's (said once, and stragglers are judged against it)."""

    cores: int
    ranks: int
    threads: int
    """intra-op threads per rank (torch's), each a core's worth of work while computing"""

    @classmethod
    def measure(cls, ranks: int, threads: int | None = None) -> HostShare:
        """This process's view: the cores it may run on (its affinity) and torch's threads."""
        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return cls(cores=cores, ranks=ranks, threads=threads or torch.get_num_threads())

    @classmethod
    def from_detail(cls, detail: Mapping[str, object]) -> HostShare | None:
        """Back from a `host` event's detail (None when it is not one)."""
        try:
            return cls(cores=int(detail["cores"]), ranks=int(detail["ranks"]), threads=int(detail["threads"]))
        except (KeyError, TypeError, ValueError):
            return None

    @property
    def factor(self) -> float:
        """Busy threads per core: above 1 the host is oversubscribed."""
        return self.ranks * self.threads / max(self.cores, 1)

    @property
    def oversubscribed(self) -> bool:
        """More busy threads than cores."""
        return self.factor > 1.0

    def detail(self) -> dict[str, object]:
        """The `host` event's detail."""
        return {
            "cores": self.cores,
            "ranks": self.ranks,
            "threads": self.threads,
            "factor": round(self.factor, 3),
        }

    def describe(self) -> str:
        """One sentence for people."""
        text = (
            f"{self.ranks} rank(s) x {self.threads} thread(s) on {self.cores} core(s)"
            f" ({self.factor:.1f} busy threads per core)"
        )
        if self.oversubscribed:
            text += (
                ": the host is oversubscribed, so ranks take turns on its cores and their step "
                "times differ for that alone; no rank is blamed for it (fewer ranks per node, "
                "fewer threads, or more cores removes it)"
            )
        return text


def process_start_time() -> float:
    """Wall-clock time this process started (Linux /proc), for recovery accounting."""
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return float("nan")
