"""Hangs and broken collectives: who is stuck, who is to blame, and where.

`HangWatch` runs beside the workers (in the launcher), never inside them: it reads each rank's
flight log header from `<run>/live/` every `poll_s` (a few hundred bytes per rank, no process
group involved). When no rank has made progress for a threshold derived from the recent step
time, or a rank died without a clean exit, it asks the live ranks for their Python stacks
(a request file their responder threads answer), reads every rank's flight-log tail and calls
`diagnose`, a pure function of those facts:

1. **mismatch**: ranks that issued the same collective (group, sequence number) with a
   different op, shape or dtype than the others, or all-to-all split sizes that do not pair
   up (rank i sends rank j what j does not expect);
2. **desync**: the same sequence number issued at different training steps: a rank skipped a
   collective earlier and has been pairing with the wrong partner since;
3. **error** / **dead**: a rank that raised or vanished (no clean exit) while peers wait;
4. **missing** / **compute**: ranks that never entered the collective the others wait in,
   and where they are instead (another collective, or compute per their stack);
5. **stuck**: everyone entered it; the transport or a device is at fault.

A run directory is per node, so each node's watchdog reads its own ranks. With several nodes
it asks the others through the rendezvous store (`NodeExchange`) for their tails and stacks
before diagnosing; without the store, ranks it cannot see are reported as unseen, never blamed.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from meshscope.collector.flightlog import (
    REQUEST_FILE,
    FlightLogError,
    FlightRecord,
    FlightTail,
    latest_logs,
    read_flight,
)

log = logging.getLogger("meshscope.hang")
ALL_TO_ALL = ("all_to_all", "all_to_all_single")
# Errors a rank gets because a peer went away: it is a victim, not the culprit.
PEER_LOST = (
    "Connection closed",
    "Connection reset",
    "Read error",
    "Broken pipe",
    "Timed out waiting",
    "NCCL communicator was aborted",
    "Socket Timeout",
)


class HangConfig(BaseModel):
    """When a stall counts as a hang, and what to do about it (the `[hang]` TOML section)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_stall_s: float = Field(
        3.0, gt=0, description="never call a stall shorter than this a hang (`--hang-after`)"
    )
    step_factor: float = Field(
        20.0, gt=0, description="...nor one shorter than this many typical steps (slow models get longer)"
    )
    startup_s: float = Field(
        120.0, gt=0, description="before the first step finishes there is no step time: this long is a hang"
    )
    poll_s: float = Field(0.25, gt=0, description="how often the flight-log headers are read")
    stacks_wait_s: float = Field(1.5, gt=0, description="how long the live ranks get to answer with stacks")
    on_hang: Literal["report", "abort"] = Field(
        "report",
        description="report: event, metric and alert; abort: also kill the workers, so the "
        "elastic agent restarts them from the last checkpoint",
    )

    def threshold_s(self, step_s: float) -> float:
        """Seconds without progress that make a hang, given the typical step time."""
        if step_s <= 0:
            return self.startup_s
        return max(self.min_stall_s, self.step_factor * step_s)


@dataclass
class Diagnosis:
    """What the watchdog concluded: the `hang` event's detail."""

    kind: str
    culprit_ranks: list[int]
    waiting_ranks: list[int]
    why: str
    op: str | None = None
    seq: int | None = None
    group: str | None = None
    stacks: dict[int, list[str]] = field(default_factory=dict)
    evidence: dict[str, Any] = field(default_factory=dict)

    def detail(self) -> dict[str, Any]:
        """The `hang` event's detail (JSON-ready)."""
        return {
            "type": self.kind,
            "culprit_ranks": self.culprit_ranks,
            "waiting_ranks": self.waiting_ranks,
            "op": self.op,
            "seq": self.seq,
            "group": self.group,
            "why": self.why,
            "stacks": {str(r): s for r, s in self.stacks.items()},
            **self.evidence,
        }


# --- diagnosis ------------------------------------------------------------------------------


def _ranks(ranks: Any) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _members(tails: dict[int, FlightTail], group: str, world: int) -> list[int]:
    for tail in tails.values():
        if group in tail.groups:
            return list(tail.groups[group])
    return list(range(world))


def _where(tail: FlightTail | None, stack: list[str] | None) -> str:
    """Where a rank is: the innermost frame of its main thread, and the collectives it has in
    flight (an async one in flight is not necessarily where it blocks)."""
    opened = tail.open_records() if tail is not None else []
    flying = ", ".join(f"{r.op} #{r.seq} on group {r.group} from {r.site}" for r in opened[-2:])
    if stack:
        return f"at {stack[-1]}" + (f" with {flying} in flight" if flying else " (no collective in flight)")
    if flying:
        return f"with {flying} in flight"
    return "somewhere unknown (no stack, no collective in flight)"


def _majority(values: dict[int, Any]) -> tuple[Any, list[int]]:
    """The most common value and the ranks that differ from it (none on a tie of two)."""
    counts = Counter(values.values()).most_common()
    if len(counts) > 1 and counts[0][1] == counts[1][1]:
        return counts[0][0], []
    common = counts[0][0]
    return common, sorted(r for r, v in values.items() if v != common)


def _split_culprits(records: dict[int, FlightRecord], members: list[int]) -> list[int]:
    """Ranks whose all-to-all sends do not match what the receivers expect."""

    def sizes(text: str, key: str) -> list[int] | None:
        part = next((p for p in text.split() if p.startswith(key + "=")), None)
        if part is None or part.endswith("=even"):
            return None
        return [int(x) for x in part.split("=", 1)[1].split(",")]

    blame: Counter[int] = Counter()
    for i, ri in records.items():
        send = sizes(ri.splits, "in")
        for j, rj in records.items():
            expect = sizes(rj.splits, "out")
            if send is None or expect is None or i == j:
                continue
            pi, pj = members.index(i), members.index(j)
            if pj < len(send) and pi < len(expect) and send[pj] != expect[pi]:
                blame[i] += 1
                blame[j] += 1
    if not blame:
        return []
    top = max(blame.values())
    return sorted(r for r, n in blame.items() if n == top)


def _mismatch(tails: dict[int, FlightTail], world: int) -> Diagnosis | None:
    """The earliest collective whose signature differs between ranks."""
    found: list[tuple[float, Diagnosis]] = []
    by_key: dict[tuple[str, int], dict[int, FlightRecord]] = {}
    for rank, tail in tails.items():
        for r in tail.records:
            if r.op not in ("send", "recv", "isend", "irecv"):
                by_key.setdefault((r.group, r.seq), {})[rank] = r
    for (group, seq), records in by_key.items():
        if len(records) < 2:
            continue
        members = _members(tails, group, world)
        a2a = all(r.op in ALL_TO_ALL for r in records.values())
        sig = {rank: _signature(r, a2a) for rank, r in records.items()}
        common, odd = _majority(sig)
        what = "op/shape/dtype"
        if not odd and len(set(sig.values())) > 1:
            # No majority (two ranks): the one that changed what it issues from this call site
            # is the odd one; when neither or both did, either may be wrong.
            odd = _changed_from_history(tails, records, a2a) or sorted(records)
        if not odd and a2a:
            odd, what = _split_culprits(records, members), "split sizes"
        if not odd:
            continue
        sample = records[odd[0]]
        others = [r for r in records if r not in odd]
        theirs = records[others[0]] if others else None
        why = (
            f"{_ranks(odd)} issued {sample.op} #{seq} on group {group} with "
            f"{_signature_text(sample)}"
            + (f" while {_ranks(others)} issued {_signature_text(theirs)}" if theirs else "")
            + f" ({what} mismatch, at {sample.site})"
        )
        t = min(r.t_issue for r in records.values())
        found.append(
            (
                t,
                Diagnosis(
                    "mismatch",
                    odd,
                    others,
                    why,
                    op=sample.op,
                    seq=seq,
                    group=group,
                    evidence={"mismatch": what},
                ),
            )
        )
    return min(found, key=lambda x: x[0])[1] if found else None


def _signature(r: FlightRecord, a2a: bool) -> tuple:
    return (r.op, r.dtype) if a2a else (r.op, r.shapes, r.dtype)


def _same_place_before(tail: FlightTail, rec: FlightRecord) -> FlightRecord | None:
    """The record a rank issued at the same place of the previous step (the n-th collective of
    its group in step s-1 for the n-th of step s): what it issues there rarely changes."""
    if rec.step is None or rec.step < 1:
        return None
    group = [r for r in tail.records if r.group == rec.group]
    place = sum(1 for r in group if r.step == rec.step and r.seq < rec.seq)
    before = sorted((r for r in group if r.step == rec.step - 1), key=lambda r: r.seq)
    return before[place] if place < len(before) else None


def _changed_from_history(
    tails: dict[int, FlightTail], records: dict[int, FlightRecord], a2a: bool
) -> list[int]:
    """Ranks whose record differs from what they issued at the same place one step earlier;
    [] unless only some ranks changed."""
    changed = []
    for rank, rec in records.items():
        before = _same_place_before(tails[rank], rec)
        if before is not None and _signature(before, a2a) != _signature(rec, a2a):
            changed.append(rank)
    return sorted(changed) if 0 < len(changed) < len(records) else []


def _signature_text(r: FlightRecord) -> str:
    parts = [r.op, f"shape {r.shapes or '-'}", f"dtype {r.dtype or '-'}"]
    if r.splits:
        parts.append(r.splits)
    return ", ".join(parts)


def _desync(tails: dict[int, FlightTail], world: int) -> Diagnosis | None:
    """Ranks pairing collectives of different steps: one skipped a collective earlier.

    Credible only when the group was in step before (a matching sequence number earlier) and
    stays out of step after, the same way, over at least two later steps: a group used off
    the training loop (a background checkpoint's barriers) matches or not by timing alone."""
    by_group: dict[str, dict[int, dict[int, FlightRecord]]] = {}
    for rank, tail in tails.items():
        for r in tail.records:
            if r.step >= 0 and r.op not in ("send", "recv", "isend", "irecv"):
                by_group.setdefault(r.group, {}).setdefault(r.seq, {})[rank] = r
    found = []
    for group, seqs in by_group.items():
        order = sorted(seqs)
        agreed = False
        for i, seq in enumerate(order):
            records = seqs[seq]
            steps = {rank: r.step for rank, r in records.items()}
            _, odd = _majority(steps)
            if not odd:
                agreed = agreed or len(records) > 1
                continue
            if not agreed:
                break  # never in step: not a training-loop group
            offset = {r: steps[r] - _majority(steps)[0] for r in odd}
            later = [seqs[k] for k in order[i + 1 :] if len(seqs[k]) > 1]
            # ...over steps to come, not one burst (a checkpoint's two barriers)
            spans_steps = len({rec.step for recs in later for q, rec in recs.items() if q not in odd}) >= 2
            persistent = spans_steps and all(
                all(
                    r not in recs
                    or recs[r].step - _majority({q: x.step for q, x in recs.items()})[0] == offset[r]
                    for r in odd
                )
                for recs in later
            )
            if persistent:
                found.append((min(r.t_issue for r in records.values()), group, seq, records, steps, odd))
            break
    if not found:
        return None
    _, group, seq, records, steps, odd = min(found, key=lambda f: f[0])
    others = [r for r in records if r not in odd]
    first = min(steps[r] for r in others)
    behind = [r for r in odd if steps[r] > first]  # their #seq came a step later
    return Diagnosis(
        "desync",
        odd,
        others,
        f"{_ranks(odd)} issued {records[odd[0]].op} #{seq} on group {group} at step "
        f"{steps[odd[0]]} while {_ranks(others)} did at step {first}: "
        + ("it" if len(odd) == 1 else "they")
        + (" skipped a collective" if behind else " issued an extra collective")
        + f" around step {min(first, steps[odd[0]])} and "
        + ("has" if len(odd) == 1 else "have")
        + " paired with the wrong partner since",
        op=records[odd[0]].op,
        seq=seq,
        group=group,
        evidence={"desync_since_step": min(first, steps[odd[0]])},
    )


def _reference_order(tails: dict[int, FlightTail], before: int) -> list[str]:
    """The call sites of one step in program order, from the latest step before `before`
    that every rank ran the same way (a rank that skipped a collective ran its step
    differently, so its own steps are no reference)."""
    by_step: dict[int, dict[int, list[str]]] = {}
    for rank, tail in tails.items():
        for r in sorted(tail.records, key=lambda r: r.t_issue):
            if 0 <= r.step < before:
                sites = by_step.setdefault(r.step, {}).setdefault(rank, [])
                if r.site not in sites:
                    sites.append(r.site)
    for step in sorted(by_step, reverse=True):
        orders = by_step[step]
        if len(orders) == len(tails) and all(o == orders[next(iter(orders))] for o in orders.values()):
            return orders[next(iter(orders))]
    return []


def _frontier(tails: dict[int, FlightTail]) -> tuple[str, int, str, list[int]] | None:
    """The collective the waiting ranks are stuck in: (group, seq, op, waiting ranks).

    Ranks may wait in different collectives: in a deadlock between groups (a rank skipped
    the gradient all-reduce and waits in the next step-end all-reduce, while its peers wait
    in the gradient one) the one that comes first in the program is the one that was
    skipped. Program order: step, then the call site's place in a step every rank ran alike
    (`_reference_order`); ties go to the collective most ranks wait in."""
    oldest = {}
    for rank, tail in tails.items():
        opened = [r for r in tail.open_records() if r.op not in ("isend", "irecv")]
        if opened:
            oldest[rank] = min(opened, key=lambda r: r.t_issue)
    if not oldest:
        return None
    key_count = Counter((r.group, r.seq) for r in oldest.values())
    steps = [r.step for r in oldest.values() if r.step >= 0]
    reference = _reference_order(tails, min(steps)) if steps else []

    def order(key: tuple[str, int]) -> tuple:
        rec = next(r for r in oldest.values() if (r.group, r.seq) == key)
        step = rec.step if rec.step >= 0 else float("inf")
        place = reference.index(rec.site) if rec.site in reference else float("inf")
        return (step, place, -key_count[key], key[1])

    group, seq = min(key_count, key=order)
    waiting = sorted(r for r, rec in oldest.items() if (rec.group, rec.seq) == (group, seq))
    return group, seq, oldest[waiting[0]].op, waiting


def diagnose(
    tails: dict[int, FlightTail],
    world: int,
    *,
    alive: dict[int, bool] | None = None,
    stacks: dict[int, list[str]] | None = None,
) -> Diagnosis:
    """Explain a stall from every rank's flight-log tail, liveness and stacks (module doc)."""
    alive = alive or {}
    stacks = stacks or {}
    diag = _diagnose(tails, world, alive, stacks)
    diag.stacks = {r: s for r, s in stacks.items()}
    return diag


def _diagnose(
    tails: dict[int, FlightTail], world: int, alive: dict[int, bool], stacks: dict[int, list[str]]
) -> Diagnosis:
    frontier = _frontier(tails)
    waiting = frontier[3] if frontier else []
    mismatch = _mismatch(tails, world)
    if mismatch is not None:
        return mismatch
    desync = _desync(tails, world)
    if desync is not None:
        return desync
    raised = sorted(
        r
        for r, t in tails.items()
        if t.last_error and t.closed and not any(p in t.last_error for p in PEER_LOST)
    )
    if raised:
        t = tails[raised[0]]
        return Diagnosis(
            "error",
            raised,
            waiting,
            f"{_ranks(raised)} stopped with an error at step {t.step} "
            f"({t.last_error}) while {_ranks(waiting) if waiting else 'its peers'} "
            "waited",
            evidence={"error": t.last_error},
        )
    dead = sorted(
        r for r in range(world) if (r not in tails or not tails[r].closed) and alive.get(r) is False
    )
    victims = [r for r, t in tails.items() if any(p in t.last_error for p in PEER_LOST)]
    dead = [r for r in dead if r not in victims] or dead
    if dead:
        steps = {r: tails[r].step for r in dead if r in tails}
        where = f"in {frontier[2]} #{frontier[1]} on group {frontier[0]}" if frontier else ""
        return Diagnosis(
            "dead",
            dead,
            [r for r in waiting if r not in dead],
            f"{_ranks(dead)} died without a clean exit (last step "
            f"{max(steps.values(), default=-1)})"
            + (
                f" while {_ranks(set(waiting) - set(dead))} waited {where}"
                if set(waiting) - set(dead)
                else ""
            ),
            op=frontier[2] if frontier else None,
            seq=frontier[1] if frontier else None,
            group=frontier[0] if frontier else None,
        )
    if frontier is None:
        return Diagnosis(
            "compute",
            sorted(tails),
            [],
            "no rank is in a collective and none progresses: all are stuck "
            "in compute or input ("
            + "; ".join(f"rank {r} {_where(None, stacks.get(r))}" for r in sorted(tails))
            + ")",
        )
    group, seq, op, waiting = frontier
    members = _members(tails, group, world)
    unseen = [r for r in members if r not in tails]  # another node's, not shared with us
    absent = [r for r in members if r in tails and tails[r].last_seq(group) < seq]
    if not absent and unseen:
        return Diagnosis(
            "remote",
            unseen,
            waiting,
            f"every rank seen here entered {op} #{seq} on group {group}; "
            f"{_ranks(unseen)} left nothing to read here (another node's ranks, "
            "or no dump): one of them is behind",
            op=op,
            seq=seq,
            group=group,
            evidence={"unseen_ranks": unseen},
        )
    if absent:
        # compute: its stack shows it outside any collective; without a stack (a post-mortem)
        # or with a collective in flight elsewhere it is only known to be missing
        in_compute = all(stacks.get(r) and not (tails.get(r) and tails[r].open_records()) for r in absent)
        kind = "compute" if in_compute else "missing"
        places = "; ".join(f"rank {r} is {_where(tails.get(r), stacks.get(r))}" for r in absent)
        return Diagnosis(
            kind,
            absent,
            waiting,
            f"{_ranks(absent)} never entered {op} #{seq} on group {group} that "
            f"{_ranks(waiting)} {'waits' if len(waiting) == 1 else 'wait'} in "
            f"({places})",
            op=op,
            seq=seq,
            group=group,
        )
    return Diagnosis(
        "stuck",
        [],
        waiting,
        f"every rank of group {group} entered {op} #{seq} and it does not "
        "complete: the transport or a device is at fault, not a rank's code",
        op=op,
        seq=seq,
        group=group,
    )


# --- watching -------------------------------------------------------------------------------

# --- several nodes ----------------------------------------------------------------------------


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

    def __init__(self, store: Any, prefix: str = "meshscope/hang") -> None:
        """`store`: a c10d store, or a callable that connects to one (retried until it does:
        the rendezvous store may come up after the watchdog)."""
        self._store, self.prefix = store, prefix
        self._answered_ids: set[str] = set()
        self._seen = 0

    @property
    def store(self) -> Any:
        if callable(self._store) and not hasattr(self._store, "set"):
            self._store = self._store()
        return self._store

    def request(self, request_id: str) -> None:
        """Ask every node for its tails (requests are numbered: none overwrites another)."""
        index = self.store.add(f"{self.prefix}/requests", 1) - 1
        self.store.set(f"{self.prefix}/request/{index}", request_id)
        self._answered_ids.add(request_id)  # our own answer goes in with the request

    def pending(self) -> list[str]:
        """Requests from other nodes not yet answered."""
        count = self.store.add(f"{self.prefix}/requests", 0)
        out = []
        while self._seen < count:
            key = f"{self.prefix}/request/{self._seen}"
            if not self.store.check([key]):
                break  # counted, not yet written
            request_id = self.store.get(key).decode()
            self._seen += 1
            if request_id not in self._answered_ids:
                out.append(request_id)
        return out

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
        mine: tuple[dict[int, FlightTail], dict[int, list[str]]] | None = None,
    ) -> tuple[dict[int, FlightTail], dict[int, list[str]]]:
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


def pid_alive(pid: int) -> bool:
    """A live process (a zombie, dead but not yet reaped by torchrun, counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


class HangWatch:
    """Watches one node's ranks through their flight logs; see the module doc."""

    def __init__(
        self,
        live_dir: Path,
        config: HangConfig | None = None,
        on_hang: Callable[[Diagnosis], None] = lambda d: None,
        clock: Callable[[], float] = time.time,
        leader: Callable[[], bool] = lambda: True,
        exchange: NodeExchange | None = None,
    ) -> None:
        self.live_dir = Path(live_dir)
        self.exchange = exchange  # several nodes: tails and stacks through the store
        self.leader = leader  # agents sharing a run directory: one watches
        self.config = config or HangConfig()
        self.on_hang, self.clock = on_hang, clock
        self.diagnosed: dict[frozenset, float] = {}  # attempt -> its progress when diagnosed
        self.last: Diagnosis | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="meshscope-hang", daemon=True)

    def start(self) -> HangWatch:
        """Poll on a thread of its own until `stop()`."""
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.config.poll_s):
            try:
                self.poll()
            except Exception:  # watching must never take training down
                log.exception("hang watch round failed")

    def poll(self) -> Diagnosis | None:
        """One look; a diagnosis (also handed to `on_hang`) when this attempt is stuck."""
        if not self.live_dir.is_dir() or not self.leader():
            return None
        heads = latest_logs(self.live_dir)
        if not heads:
            return None
        if self.exchange is not None:
            try:
                self._answer(heads)
            except Exception as err:  # the store is not up (yet): this node answers later
                log.debug("hang exchange: %s", err)
        attempt = frozenset((r, h.pid) for r, h in heads.items())
        progress = max(h.progress_t for h in heads.values())
        if attempt in self.diagnosed and self.diagnosed[attempt] >= progress:
            return None  # diagnosed, and nothing moved since (a new stall is judged anew)
        if all(h.closed for h in heads.values()) and not any(h.last_error for h in heads.values()):
            return None  # a clean end
        world = max(h.world_size for h in heads.values())
        alive = {r: pid_alive(h.pid) for r, h in heads.items()}
        dead = [r for r, h in heads.items() if not h.closed and not alive[r]]
        running = [h for r, h in heads.items() if not h.closed and alive[r]]
        failed = any(h.closed and h.last_error for h in heads.values())
        if not dead and not failed and running:
            idle = self.clock() - max(h.progress_t for h in running)
            if idle < self.config.threshold_s(max(h.step_s for h in running)):
                return None
        elif not dead and not failed:
            return None
        # a crash is judged once per attempt; a stall again if progress resumes and stops
        self.diagnosed[attempt] = float("inf") if dead or failed else progress
        tails, stacks = self._local_picture(heads, [r for r, h in heads.items() if alive[r] and not h.closed])
        if self.exchange is not None and len(tails) < world:
            try:
                request_id = f"{os.getpid()}-{self.clock():.6f}"
                self.exchange.request(request_id)
                self.exchange.publish(request_id, tails, stacks)
                remote_tails, remote_stacks = self.exchange.gather(
                    request_id,
                    world,
                    self.config.stacks_wait_s + 4 * self.config.poll_s,
                    mine=(tails, stacks),
                )
                tails = {**remote_tails, **tails}
                stacks = {**remote_stacks, **stacks}
            except Exception as err:  # no store: diagnose what this node sees
                log.warning("hang exchange with other nodes failed: %s", err)
        diag = diagnose(tails, world, alive=alive, stacks=stacks)
        diag.evidence["detected_at"] = self.clock()
        diag.evidence["stalled_since"] = max((h.progress_t for h in heads.values()), default=0.0)
        diag.evidence["pids"] = {str(r): h.pid for r, h in heads.items()}
        diag.evidence["step"] = max((t.step for t in tails.values()), default=-1)
        self.last = diag
        self.on_hang(diag)
        return diag

    def _answer(self, heads: dict[int, FlightTail]) -> None:
        """Other nodes' watchdogs asked: send this node's tails and stacks."""
        requests = self.exchange.pending()
        if not requests:
            return
        tails, stacks = self._local_picture(
            heads, [r for r, h in heads.items() if not h.closed and pid_alive(h.pid)]
        )
        for request_id in requests:
            self.exchange.publish(request_id, tails, stacks)

    def _local_picture(
        self, heads: dict[int, FlightTail], live: list[int]
    ) -> tuple[dict[int, FlightTail], dict[int, list[str]]]:
        """This node's ranks: every flight-log tail, the live ranks' stacks, and the crash
        stacks of the ranks that could not answer."""
        stacks = self._gather_stacks(live, heads)
        tails = {}
        for rank, head in heads.items():
            try:
                tails[rank] = read_flight(head.path)
            except (OSError, FlightLogError):
                continue
        for rank, head in heads.items():
            if rank not in stacks:
                crash = _crash_stack(head.path)
                if crash:
                    stacks[rank] = crash
        return tails, stacks

    def _gather_stacks(self, ranks: list[int], heads: dict[int, FlightTail]) -> dict[int, list[str]]:
        """Ask the live ranks for their stacks and wait a little for the answers."""
        request_id = f"{self.clock():.6f}"
        tmp = self.live_dir / f"{REQUEST_FILE}.tmp"
        tmp.write_text(request_id)
        os.replace(tmp, self.live_dir / REQUEST_FILE)
        deadline = time.monotonic() + self.config.stacks_wait_s
        stacks: dict[int, list[str]] = {}
        while time.monotonic() < deadline and len(stacks) < len(ranks):
            for rank in ranks:
                if rank not in stacks:
                    answer = _stack_answer(heads[rank].path, request_id)
                    if answer is not None:
                        stacks[rank] = answer
            time.sleep(0.05)
        return stacks


def _stack_answer(path: Path, request_id: str | None) -> list[str] | None:
    """The main thread's stack a rank wrote for `request_id` (None: whatever it wrote last)."""
    try:
        data = json.loads(path.with_suffix(".stacks.json").read_text())
    except (OSError, ValueError):
        return None
    if request_id is not None and data.get("request") != request_id:
        return None
    main = next(iter(data.get("stacks", {}).values()), None)
    return main


def _crash_stack(path: Path) -> list[str]:
    """The crashing thread's frames from a faulthandler dump (a rank that aborted), outermost
    first like the responder's stacks."""
    try:
        text = path.with_suffix(".crash").read_text(errors="replace")
    except OSError:
        return []
    sections = text.split("\n\n")
    current = next((s for s in sections if "Current thread" in s), sections[0])
    frames = []
    for line in current.splitlines():
        line = line.strip()
        if line.startswith('File "') and "line " in line:
            where = "/".join(line.split('"')[1].rsplit("/", 2)[-2:])
            frames.append(f"{where}:{line.split('line ', 1)[1]}")
    return frames[::-1]


def diagnose_folder(live_dir: Path) -> Diagnosis | None:
    """A post-mortem: the newest attempt's flight logs, crash dumps and last stacks."""
    heads = latest_logs(live_dir) if Path(live_dir).is_dir() else {}
    if not heads:
        return None
    tails = {r: read_flight(h.path) for r, h in heads.items()}
    stacks = {}
    for rank, head in heads.items():
        stack = _crash_stack(head.path) or _stack_answer(head.path, None)
        if stack:
            stacks[rank] = stack
    world = max(h.world_size for h in heads.values())
    alive = {r: pid_alive(h.pid) for r, h in heads.items()}
    return diagnose(tails, world, alive=alive, stacks=stacks)


__all__ = ["Diagnosis", "HangConfig", "HangWatch", "diagnose", "diagnose_folder", "pid_alive"]
