"""Heartbeats through the rendezvous store, independent of the process group.

Every rank writes `hb/<attempt>/<rank>` = "<time> <step>" each interval from a thread, and
watches its peers: a peer whose beat has not changed for 1.5 intervals (checked every half
interval, so within two intervals of its death) is reported once, by the lowest rank that is
itself alive. Survivors that torchrun stops write an exit mark on SIGTERM; a rank of a previous
attempt with a beat but no exit mark died abruptly: that is how a restarted attempt names the
rank that failed.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

PREFIX = "meshscope"
log = logging.getLogger("meshscope.heartbeat")


def hb_key(attempt: int, rank: int) -> str:
    return f"{PREFIX}/hb/{attempt}/{rank}"


def exit_key(attempt: int, rank: int) -> str:
    return f"{PREFIX}/exit/{attempt}/{rank}"


def world_key(attempt: int) -> str:
    return f"{PREFIX}/world/{attempt}"


def connect_store(host: str, port: int) -> dist.Store:
    """A client of the agent's store of our own: beats never queue behind the process group."""
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))


def _get(store: dist.Store, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None


@dataclass
class PeerFailure:
    rank: int
    last_seen: float
    last_step: int
    exit: str | None


def previous_attempt_failures(store: dist.Store, attempt: int) -> list[PeerFailure]:
    """Ranks of `attempt - 1` that beat but left no exit mark: they died abruptly."""
    prev = attempt - 1
    raw_world = _get(store, world_key(prev)) if prev >= 0 else None
    if raw_world is None:
        return []
    failures = []
    for rank in range(int(raw_world)):
        beat = _get(store, hb_key(prev, rank))
        mark = _get(store, exit_key(prev, rank))
        if beat is not None and mark is None:
            t, step = beat.split()
            failures.append(PeerFailure(rank, float(t), int(step), None))
    return failures


def world_of(store: dist.Store, attempt: int) -> int | None:
    """World size of a past attempt, as its rank 0 recorded it."""
    raw = _get(store, world_key(attempt))
    return int(raw) if raw is not None else None


def exit_marks(store: dist.Store, attempt: int, world_size: int) -> dict[int, float]:
    """rank -> time of the exit mark each survivor of `attempt` wrote."""
    out = {}
    for rank in range(world_size):
        mark = _get(store, exit_key(attempt, rank))
        if mark is not None:
            out[rank] = float(mark.split()[1])
    return out


class Heartbeat:
    def __init__(self, store: dist.Store, *, rank: int, world_size: int, attempt: int,
                 interval_s: float = 1.0,
                 on_dead: Callable[[int, float, int], None] = lambda r, age, step: None,
                 on_age: Callable[[int, float], None] = lambda r, age: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.rank, self.world, self.attempt = store, rank, world_size, attempt
        self.interval = interval_s
        self.on_dead, self.on_age, self.clock = on_dead, on_age, clock
        self.step = -1
        self._stop = threading.Event()
        self._seen: dict[int, tuple[str, float]] = {}
        self._reported: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="meshscope-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        if self.rank == 0:
            self.store.set(world_key(self.attempt), str(self.world))
        self._beat()
        self._thread.start()
        return self

    def mark_exit(self, reason: str) -> None:
        """Say this rank left on purpose (SIGTERM, done): it is not a failure."""
        self.store.set(exit_key(self.attempt, self.rank), f"{reason} {time.time()}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _beat(self) -> None:
        self.store.set(hb_key(self.attempt, self.rank), f"{time.time()} {self.step}")

    def _run(self) -> None:
        last_beat = self.clock()
        while not self._stop.wait(self.interval / 2):
            try:
                if self.clock() - last_beat >= self.interval:
                    self._beat()
                    last_beat = self.clock()
                self._watch()
            except Exception as err:  # the store went away: the agent is tearing the group down
                log.warning("heartbeat of rank %d stopped: %s", self.rank, err)
                return

    def _watch(self) -> None:
        now = self.clock()
        ages = {}
        for peer in range(self.world):
            if peer == self.rank:
                continue
            value = _get(self.store, hb_key(self.attempt, peer))
            if value is None:
                continue
            seen = self._seen.get(peer)
            if seen is None or seen[0] != value:
                self._seen[peer] = (value, now)
            ages[peer] = now - self._seen[peer][1]
            self.on_age(peer, ages[peer])
        dead = {p for p, age in ages.items() if age > 1.5 * self.interval}
        alive_below_me = [p for p in range(self.rank) if p not in dead and p in ages]
        if alive_below_me:
            return  # a lower live rank reports
        for peer in sorted(dead - self._reported):
            self._reported.add(peer)
            if _get(self.store, exit_key(self.attempt, peer)) is None:
                step = int(self._seen[peer][0].split()[1])
                self.on_dead(peer, ages[peer], step)
