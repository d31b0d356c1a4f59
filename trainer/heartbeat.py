"""Heartbeats through the rendezvous store, independent of the process group, O(N) in all.

Every rank writes `hb/<attempt>/<rank>` = "<time> <step>" each interval from a thread: one
write, no reads. One watcher per node (local rank 0) reads its node's beats in one `multi_get`
every half interval: a rank whose beat has not changed for 1.5 intervals (so within two
intervals of its death; 10 before its first step, while imports and compiling can starve its
beat on a busy host) and left no exit mark is reported once; the watcher exports its own
ranks' ages only and writes a node summary. With several nodes, one job watcher (rank 0)
reads the summaries: a node whose summary stopped changing lost its watcher (it died, or its
local rank 0 finished first), and its ranks that stopped beating without an exit mark are
reported. Per interval: N beats, one read and one write per node, one read for the job
(the old design, where every rank read every peer, made 4 N^2 store operations: 4 million a
second at 1,024 ranks; see benchmarks/watchdog_scale.py).

Survivors that torchrun stops write an exit mark on SIGTERM; a rank of a previous attempt with
a beat but no exit mark died abruptly: that is how a restarted attempt names the rank that
failed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from meshscope.collector.service import Service

PREFIX = "meshscope"


def hb_key(attempt: int, rank: int) -> str:
    """The store key of a rank's heartbeat in one attempt."""
    return f"{PREFIX}/hb/{attempt}/{rank}"


def exit_key(attempt: int, rank: int) -> str:
    """The store key of a rank's clean or failed exit in one attempt."""
    return f"{PREFIX}/exit/{attempt}/{rank}"


def world_key(attempt: int) -> str:
    """The store key of an attempt's world size."""
    return f"{PREFIX}/world/{attempt}"


def connect_store(host: str, port: int, job: str = "") -> dist.Store:
    """A client of the agent's store of our own: beats never queue behind the process group.
    With `job`, every key is under `job/<job>/`: two jobs on one long-lived store never see
    each other's ranks."""
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
    return dist.PrefixStore(f"job/{job}", store) if job else store


def _get(store: dist.Store, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None


@dataclass
class PeerFailure:
    """A peer whose heartbeat stopped: who, when it was last seen, and at which step."""

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


class Heartbeat(Service):
    """This rank's beat: one store write per interval, from a thread. Ranks never read their
    peers' beats (that was N x N reads per interval); the watchers below do, O(N) in all."""

    ends_on_error = True

    def __init__(
        self, store: dist.Store, *, rank: int, world_size: int, attempt: int, interval_s: float = 1.0
    ) -> None:
        self.store, self.rank, self.world, self.attempt = store, rank, world_size, attempt
        self.interval = interval_s
        self.step = -1
        super().__init__("meshscope-heartbeat", interval_s)

    def start(self) -> Heartbeat:
        """Start beating on a thread of its own."""
        if self.rank == 0:
            self.store.set(world_key(self.attempt), str(self.world))
        self._beat()
        super().start()
        return self

    def mark_exit(self, reason: str) -> None:
        """Say this rank left on purpose (SIGTERM, done): it is not a failure."""
        self.store.set(exit_key(self.attempt, self.rank), f"{reason} {time.time()}")

    def _beat(self) -> None:
        self.store.set(hb_key(self.attempt, self.rank), f"{time.time()} {self.step}")

    def round(self) -> None:
        """One beat (a store gone away ends the beating: the agent tears the group down)."""
        self._beat()


def node_key(attempt: int, node: int) -> str:
    """Where a node's watcher writes its summary."""
    return f"{PREFIX}/node/{attempt}/{node}"


SILENT_INTERVALS = 1.5  # a beat unchanged this long (in intervals) and no exit mark: gone
# Before its first step a rank imports, builds and compiles: work that can hold the
# interpreter for seconds on a busy host, its beat thread with it. Gone takes longer then.
STARTING_INTERVALS = 10.0


def silent_after(beat: bytes, interval: float) -> float:
    """Seconds without a new beat after which the rank that wrote `beat` is gone."""
    step = int(beat.decode().split()[1])
    return (STARTING_INTERVALS if step < 0 else SILENT_INTERVALS) * interval


class _Ages:
    """When each watched value last changed: its age, on our own clock."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._seen: dict[Any, tuple[bytes, float]] = {}

    def age(self, key: Any, value: bytes) -> float:
        now = self.clock()
        seen = self._seen.get(key)
        if seen is None or seen[0] != value:
            self._seen[key] = (value, now)
            return 0.0
        return now - seen[1]


class _Watcher(Service):
    """A thread that looks every half interval; a death is reported once."""

    ends_on_error = True

    def __init__(self, interval_s: float, clock: Callable[[], float], name: str) -> None:
        self.interval, self.clock = interval_s, clock
        self.ages = _Ages(clock)
        self.reported: set[int] = set()
        super().__init__(name, interval_s / 2)

    def round(self) -> None:
        """One look (a store gone away ends the watching: the agent is tearing down)."""
        self.look()

    def look(self) -> None:
        raise NotImplementedError


class NodeWatch(_Watcher):
    """One per node (local rank 0): reads its node's beats in one `multi_get`, reports a local
    rank whose beat stopped for 1.5 intervals without an exit mark, exports the ages of its
    own ranks only (and drops a departed rank's series), and writes the node's summary for
    the job's watcher: one read and one write per interval, whatever the job's size."""

    def __init__(
        self,
        store: dist.Store,
        *,
        attempt: int,
        node: int,
        ranks: list[int],
        interval_s: float = 1.0,
        on_dead: Callable[[int, float, int], None] = lambda r, age, step: None,
        on_age: Callable[[int, float | None], None] = lambda r, age: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(interval_s, clock, "meshscope-node-watch")
        self.store, self.attempt, self.node, self.ranks = store, attempt, node, ranks
        self.on_dead, self.on_age = on_dead, on_age

    def look(self) -> None:
        """Read this node's beats once; export ages, report the silent."""
        beats = (
            self.store.multi_get([hb_key(self.attempt, r) for r in self.ranks])
            if _all_set(self.store, [hb_key(self.attempt, r) for r in self.ranks])
            else None
        )
        if beats is None:
            return  # a rank has not beaten yet: it is still starting
        dead = {}
        for rank, value in zip(self.ranks, beats):
            age = self.ages.age(rank, value)
            if rank in self.reported:
                continue
            if age > silent_after(value, self.interval) and not self.store.check(
                [exit_key(self.attempt, rank)]
            ):
                self.reported.add(rank)
                dead[rank] = age
                self.on_dead(rank, age, int(value.decode().split()[1]))
                self.on_age(rank, None)  # departed: its series goes
            else:
                self.on_age(rank, age)
        self.store.set(
            node_key(self.attempt, self.node), f"{time.time()} {','.join(map(str, sorted(self.reported)))}"
        )


class JobWatch(_Watcher):
    """One per job (global rank 0, with several nodes): reads every node's summary in one
    `multi_get`. A node whose summary stopped changing lost its watcher: the node died, or its
    local rank 0 finished first. Its ranks are then read one by one: one that left on purpose
    or still beats is alive; one that has not beaten since its node's last summary, or stops
    beating later, is reported dead."""

    def __init__(
        self,
        store: dist.Store,
        *,
        attempt: int,
        nodes: dict[int, list[int]],
        interval_s: float = 1.0,
        on_dead: Callable[[int, float, int], None] = lambda r, age, step: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(interval_s, clock, "meshscope-job-watch")
        self.store, self.attempt, self.nodes = store, attempt, nodes
        self.on_dead = on_dead
        self.settled: set[int] = set()  # ranks of watcher-less nodes reported or gone on purpose

    def look(self) -> None:
        """Read every node's summary once; read the ranks of a node whose watcher is gone."""
        keys = [node_key(self.attempt, n) for n in self.nodes]
        if not _all_set(self.store, keys):
            return
        for (node, ranks), value in zip(self.nodes.items(), self.store.multi_get(keys)):
            age = self.ages.age(node, value)
            if age <= SILENT_INTERVALS * self.interval or node in self.reported:
                continue
            if self._look_at_ranks(ranks, float(value.decode().split()[0]), age):
                self.reported.add(node)

    def _look_at_ranks(self, ranks: list[int], summary_time: float, summary_age: float) -> bool:
        """Report the ranks of a watcher-less node that died; True once each is settled. Beat
        and summary times are both of that node's clock: a rank that has not beaten since the
        summary stopped (1.5 intervals ago at least) is as silent as NodeWatch's dead."""
        for rank in ranks:
            if rank not in self.settled and self.store.check([exit_key(self.attempt, rank)]):
                self.settled.add(rank)
        unsettled = [r for r in ranks if r not in self.settled]
        # every beat is there: a node writes its summary only once all its ranks have beaten
        beats = self.store.multi_get([hb_key(self.attempt, r) for r in unsettled]) if unsettled else []
        for rank, beat in zip(unsettled, beats):
            age = self.ages.age(("rank", rank), beat)
            beat_time, step = beat.decode().split()
            starting = int(step) < 0  # silent since before the summary stopped: not yet telling
            if (float(beat_time) <= summary_time and not starting) or age > silent_after(beat, self.interval):
                self.settled.add(rank)
                self.on_dead(rank, max(age, summary_age), int(step))
        return all(r in self.settled for r in ranks)


def _all_set(store: dist.Store, keys: list[str]) -> bool:
    return bool(keys) and store.check(keys)
