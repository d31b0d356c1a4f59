"""The run directory, said once: where each part of a run lives under `runs/<run_id>/`, the
run's own description (`config.json`) read in one typed place, and the lock that makes one
agent the judge of a directory several agents share. Everything a UI or a detector needs is
found from the run directory alone."""

from __future__ import annotations

import fcntl
import json
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

STORE = "store.sqlite"  # one node's store (SQLite)
STORE_LOCATOR = "store.json"  # names the job store of a multi-node job (PostgreSQL)
CONFIG = "config.json"
LIVE = "live"  # flight logs, stack requests and answers, crash stacks
SNAPSHOTS = "snapshots"
OUTBOX = "outbox"
TARGETS = "targets.json"
LOGS = "logs"
LEADER_LOCK = "detect.lock"


def live_dir(run_dir: str | Path) -> Path:
    """Where the ranks' flight logs and the stack protocol's files are."""
    return Path(run_dir) / LIVE


def run_config(run_dir: str | Path) -> dict[str, Any]:
    """The run's config.json as written by `meshscope run` ({} when there is none or it is
    unreadable: a user's own loop has none)."""
    try:
        data = json.loads((Path(run_dir) / CONFIG).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


MODEL_FACTS = ("top_k", "experts", "capacity_factor", "aux_loss_coef")


@dataclass(frozen=True)
class RunInfo:
    """What readers need to know of a run's model; None where the run does not say (a user's
    own loop: the engine then reads top-k from the counts)."""

    top_k: int | None = None
    experts: int | None = None
    capacity_factor: float | None = None
    aux_loss_coef: float | None = None
    expert_every: int | None = None  # steps per expert-load window
    ep: int = 1  # expert parallelism: experts sharded over groups of ep ranks

    def model(self) -> dict[str, Any]:
        """The known model values as a dict (the feedback loop's view of the model)."""
        return {k: v for k in MODEL_FACTS if (v := getattr(self, k)) is not None}


def _number(value: Any, kind: type, *, low: float = 0.0, inclusive: bool = False) -> Any:
    """`value` as `kind` when it is a number above `low` (or equal, if `inclusive`), else None."""
    try:
        number = kind(value)
    except (TypeError, ValueError):
        return None
    return number if number > low or (inclusive and number == low) else None


def run_info(run_dir: str | Path) -> RunInfo:
    """The typed model facts of a run, from its config.json."""
    config = run_config(run_dir)
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    parallel = config.get("parallel") if isinstance(config.get("parallel"), dict) else {}
    # older runs kept expert_every at the top level
    monitor = config.get("monitor") if isinstance(config.get("monitor"), dict) else {}
    return RunInfo(
        ep=_number(parallel.get("ep"), int) or 1,
        expert_every=_number(monitor.get("expert_every", config.get("expert_every")), int),
        top_k=_number(model.get("top_k"), int),
        experts=_number(model.get("experts"), int),
        capacity_factor=_number(model.get("capacity_factor"), float),
        aux_loss_coef=_number(model.get("aux_loss_coef"), float, inclusive=True),
    )


class LeaderLock:
    """Agents sharing a run directory act on it once: the holder of `detect.lock` does. The
    lock dies with its process, so a surviving agent takes over on its next `held()`."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LEADER_LOCK
        self._file: IO[str] | None = None

    def held(self) -> bool:
        """True when this process holds the lock (taking it if it is free)."""
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(self.path, "w")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                lock.close()
                return False
            self._file = lock
        return True

    def release(self) -> None:
        """Give the lock up (closing the file releases it)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def job_leader(run_dir: str | Path, directory_lock: LeaderLock | None = None) -> Any:
    """The lock whose holder judges the whole job (detection, the job's hang event and alert):
    on a job store the job's database lock, which every node reaches without a shared file
    system; else the run directory's own lock — `directory_lock` when this process has one
    already (a second flock of the same file by the same process would refuse it)."""
    from meshscope.collector.storedb import PgLeaderLock, locate  # storedb reads this module's names

    target = locate(run_dir)
    if target.is_postgres:
        return PgLeaderLock(target)
    return directory_lock or LeaderLock(run_dir)


def world_size(config: dict[str, Any]) -> int:
    """Ranks of the whole job a run's config.json describes (per-node ranks x nodes, the
    largest when nodes is a range)."""
    nodes = str(config.get("elastic", {}).get("nnodes", "1")).split(":")[-1]
    return int(config.get("nproc", 1)) * (int(nodes) if nodes.isdigit() else 1)


def one_device_reference(run_dir: str | Path) -> Path | None:
    """A run of the same model, per-device batch and device on one device, beside `run_dir`
    (the newest; the run itself when it had one device): what scaling efficiency divides by.
    None when there is none, or `run_dir` has no config (a user's own loop)."""
    run_dir = Path(run_dir)
    mine = run_config(run_dir)
    if not mine:
        return None
    if world_size(mine) == 1:
        return run_dir

    def same(other: dict[str, Any]) -> bool:
        keys = ("model", "device")
        batch = other.get("train", {}).get("batch_size") == mine.get("train", {}).get("batch_size")
        return batch and world_size(other) == 1 and all(other.get(k) == mine.get(k) for k in keys)

    found = [
        p
        for p in run_dir.parent.iterdir()
        if p != run_dir and (p / CONFIG).is_file() and (p / STORE).is_file()
    ]
    found = [p for p in found if same(run_config(p))]
    return max(found, key=lambda p: (p / STORE).stat().st_mtime, default=None)
