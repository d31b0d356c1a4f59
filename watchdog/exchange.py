"""Between nodes: each node's watchdog reads only its own ranks' flight logs, so the watchdogs
swap tails and stacks through the rendezvous store (never through the stuck process group)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from meshscope.collector.flightread import (
    FlightRecord,
    FlightTail,
)

# what a node sees of its ranks: their flight-log tails and their stacks, by rank
Picture = tuple[dict[int, FlightTail], dict[int, list[str]]]


def tail_to_json(tail: FlightTail) -> dict[str, Any]:
    """A flight-log tail as JSON-ready data, to send to another node's watchdog."""
    d = asdict(tail)
    d["path"] = str(tail.path)
    return d


def tail_from_json(d: dict[str, Any]) -> FlightTail:
    """The inverse of `tail_to_json`."""
    d = dict(d)
    d["path"] = Path(d["path"])
    d["records"] = [FlightRecord(**r) for r in d["records"]]
    return FlightTail(**d)


class NodeExchange:
    """Hang diagnosis across nodes, through the rendezvous store (never the stuck group).

    The watchdog that sees a stall asks (`request`); every node's watchdog answers on its next
    poll with its ranks' flight-log tails and stacks (`publish`); the asker merges what arrives
    within its wait (`gather`) and diagnoses the whole job. A run directory is per node; the
    store is the one thing every node's watchdog can reach."""

    several_nodes = True

    def __init__(self, store: Any, prefix: str = "meshscope/hang") -> None:
        """`store`: a c10d store, or a callable that connects to one (retried until it does:
        the rendezvous store may come up after the watchdog)."""
        self._store, self.prefix = store, prefix
        self._answered_ids: set[str] = set()
        self._read = {"request": 0, "verdict": 0}  # how far this node read each numbered log

    @property
    def store(self) -> Any:
        """The store, connected on first use."""
        if callable(self._store) and not hasattr(self._store, "set"):
            self._store = self._store()
        return self._store

    def _append(self, log: str, value: str) -> None:
        """Add to a numbered log in the store (numbered: no writer overwrites another)."""
        index = self.store.add(f"{self.prefix}/{log}s", 1) - 1
        self.store.set(f"{self.prefix}/{log}/{index}", value)

    def _new(self, log: str) -> list[bytes]:
        """What a numbered log gained since this node last read it (one store operation when
        nothing did)."""
        count = self.store.add(f"{self.prefix}/{log}s", 0)
        out = []
        while self._read[log] < count:
            key = f"{self.prefix}/{log}/{self._read[log]}"
            if not self.store.check([key]):
                break  # counted, not yet written
            out.append(self.store.get(key))
            self._read[log] += 1
        return out

    def request(self, request_id: str) -> None:
        """Ask every node for its tails."""
        self._append("request", request_id)
        self._answered_ids.add(request_id)  # our own answer goes in with the request

    def pending(self) -> list[str]:
        """Requests from other nodes not yet answered."""
        return [r for r in (b.decode() for b in self._new("request")) if r not in self._answered_ids]

    def post_verdict(self, detail: dict[str, Any]) -> None:
        """The job's judge posts its diagnosis once; every node's watchdog acts on it (one key
        per stall: O(nodes) reads, never a request per node)."""
        self._append("verdict", json.dumps(detail, default=str))

    def new_verdicts(self) -> list[dict[str, Any]]:
        """Verdicts posted since this node last looked."""
        return [json.loads(b) for b in self._new("verdict")]

    def publish(self, request_id: str, tails: dict[int, FlightTail], stacks: dict[int, list[str]]) -> None:
        """Answer `request_id` with this node's tails and stacks."""
        self._answered_ids.add(request_id)
        blob = json.dumps(
            {
                "tails": [tail_to_json(t) for t in tails.values()],
                "stacks": {str(r): st for r, st in stacks.items()},
            }
        )
        index = self.store.add(f"{self.prefix}/{request_id}/count", 1) - 1
        self.store.set(f"{self.prefix}/{request_id}/{index}", blob)

    def gather(
        self,
        request_id: str,
        world: int,
        wait_s: float,
        mine: Picture | None = None,
    ) -> Picture:
        """Every answer that arrives within `wait_s` (or until all `world` ranks are in).
        While it waits it answers other nodes' requests with `mine`: nodes that saw the
        stall at the same moment all get the whole picture."""
        tails: dict[int, FlightTail] = {}
        stacks: dict[int, list[str]] = {}
        deadline, seen = time.monotonic() + wait_s, 0
        while True:
            if mine is not None:
                for other in self.pending():
                    self.publish(other, *mine)
            count = self.store.add(f"{self.prefix}/{request_id}/count", 0)
            for index in range(seen, count):
                key = f"{self.prefix}/{request_id}/{index}"
                if not self.store.check([key]):
                    break  # counted, not yet written: read it next round
                data = json.loads(self.store.get(key))
                for t in data["tails"]:
                    tail = tail_from_json(t)
                    tails[tail.rank] = tail
                stacks.update({int(r): st for r, st in data["stacks"].items()})
                seen = index + 1
            if len(tails) >= world or time.monotonic() > deadline:
                return tails, stacks
            time.sleep(0.05)


class OneNode:
    """The exchange of a job on one node: nobody else to ask or answer, so the watchdog's one
    code path needs no branch for it (`NodeExchange` for several)."""

    several_nodes = False

    def request(self, request_id: str) -> None:
        """Nobody to ask."""

    def pending(self) -> list[str]:
        """Nobody asks."""
        return []

    def publish(self, request_id: str, tails: dict[int, FlightTail], stacks: dict[int, list[str]]) -> None:
        """Nobody to answer."""

    def gather(
        self,
        request_id: str,
        world: int,
        wait_s: float,
        mine: Picture | None = None,
    ) -> Picture:
        """What this node sees is the whole picture."""
        return mine if mine is not None else ({}, {})

    def post_verdict(self, detail: dict[str, Any]) -> None:
        """Nobody to tell."""

    def new_verdicts(self) -> list[dict[str, Any]]:
        """No judge but this node's own watchdog."""
        return []
