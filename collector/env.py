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
    def is_distributed(self) -> bool:
        """More than one rank."""
        return self.world_size > 1

    def local_ranks(self) -> list[int]:
        """Global ranks of this node's workers (torchrun assigns them contiguously per node)."""
        first = self.rank - self.local_rank
        return list(range(first, first + self.local_world_size))
