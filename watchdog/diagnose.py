"""The diagnosis of a stall: a pure function of every rank's flight-log tail, liveness and
stacks. `CHECKS` are asked in order; the first that recognises the picture gives the verdict:

1. **desync** by call site: on one group, number #s came from call site A on some ranks and
   from B on the others, who issue A as #s+1: the first ranks skipped B and pair silently;
2. **mismatch**: ranks that issued the same collective (group, sequence number) with a
   different op, shape or dtype than the others, or all-to-all split sizes that do not pair
   up (rank i sends rank j what j does not expect);
3. **desync** by step: the same sequence number issued at different training steps;
4. **error** / **dead**: a rank that raised while peers wait; ranks whose peers lost the
   connection to them and who left nothing to read (a node gone); a rank that vanished;
5. **none** (a post-mortem without stacks): every collective completed and matched;
6. **compute** (everywhere): no rank is in a collective and none progresses;
7. **remote** / **missing** / **compute**: the roots of the wait-for graph across every group
   (`watchdog.waitgraph`): ranks that never entered the op others wait in, and where they are
   instead (compute per their stack, another op, no log here); a rank that skipped an op and
   waits elsewhere; every other stuck rank waits on one of them and is not named;
8. **undetermined**: ranks wait on each other in a cycle and nothing says who began it;
9. **stuck**: everyone entered it: the ranks whose device never started it (a Flight
   Recorder's "scheduled" beside "started") when the dump says so, else the transport or a
   device, no rank's code.

The signature checks (1–3) read only the records (`watchdog.signatures`); a second fault
elsewhere, a root of the graph, is named beside theirs. `evidence["stuck_groups"]` lists every
op ranks wait in, whom they wait on, and the culprits that wait leads to."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshscope.collector.flightread import (
    ASYNC_P2P_OPS,
    FlightTail,
)
from meshscope.watchdog import waitgraph
from meshscope.watchdog.roots import root_text, stuck_groups, where
from meshscope.watchdog.signatures import desync, mismatch, ranks_text, shifted
from meshscope.watchdog.verdicts import Diagnosis, Verdict
from meshscope.watchdog.waitgraph import WaitGraph

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


def _lost_a_peer(tail: FlightTail) -> bool:
    """Its error says a peer went away: a victim of that peer, not a culprit."""
    return any(p in tail.last_error for p in PEER_LOST)


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


def _frontier(
    tails: dict[int, FlightTail], group: str | None = None
) -> tuple[str, int, str, list[int]] | None:
    """The collective the waiting ranks are stuck in: (group, seq, op, waiting ranks).

    Ranks may wait in different collectives: in a deadlock between groups (a rank skipped
    the gradient all-reduce and waits in the next step-end all-reduce, while its peers wait
    in the gradient one) the one that comes first in the program is the one that was
    skipped. Program order: step, then the call site's place in a step every rank ran alike
    (`_reference_order`); ties go to the collective most ranks wait in."""
    oldest = {}
    for rank, tail in tails.items():
        opened = [
            r
            for r in tail.open_records()
            if r.op not in ASYNC_P2P_OPS and (group is None or r.group == group)
        ]
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


@dataclass
class Stall:
    """The facts of one stall, as every check sees them."""

    tails: dict[int, FlightTail]
    world: int
    alive: dict[int, bool]
    stacks: dict[int, list[str]]
    frontier: tuple[str, int, str, list[int]] | None  # the collective the waiting ranks are in
    graph: WaitGraph  # who waits on whom, across every group

    @property
    def waiting(self) -> list[int]:
        """The ranks waiting in the frontier collective."""
        return self.frontier[3] if self.frontier else []

    def at_frontier(self) -> dict[str, Any]:
        """op, seq and group of the frontier collective (all None without one)."""
        group, seq, op, _ = self.frontier or (None, None, None, None)
        return {"op": op, "seq": seq, "group": group}


def _check_shifted(s: Stall) -> Diagnosis | None:
    return shifted(s.tails, s.world)


def _check_mismatch(s: Stall) -> Diagnosis | None:
    return mismatch(s.tails, s.world)


def _check_desync(s: Stall) -> Diagnosis | None:
    return desync(s.tails, s.world)


def _check_error(s: Stall) -> Diagnosis | None:
    """A rank that raised (not because a peer went away) while the others waited."""
    raised = sorted(r for r, t in s.tails.items() if t.last_error and t.closed and not _lost_a_peer(t))
    if not raised:
        return None
    t = s.tails[raised[0]]
    return Diagnosis(
        Verdict.ERROR,
        raised,
        s.waiting,
        f"{ranks_text(raised)} stopped with an error at step {t.step} ({t.last_error}) while "
        f"{ranks_text(s.waiting) if s.waiting else 'its peers'} waited",
        evidence={"error": t.last_error},
    )


def _check_dead(s: Stall) -> Diagnosis | None:
    """A rank that vanished without a clean exit (its victims, who lost the peer, are not it)."""
    tails = s.tails
    # a rank told to stop (SIGTERM) and then gone left on purpose, even if it never closed
    gone = [r for r in range(s.world) if r not in tails or not tails[r].left]
    dead = sorted(r for r in gone if s.alive.get(r) is False)
    victims = [r for r, t in tails.items() if _lost_a_peer(t)]
    dead = [r for r in dead if r not in victims] or dead
    if not dead:
        return None
    last = max((tails[r].step for r in dead if r in tails), default=-1)
    left = set(s.waiting) - set(dead)
    f = s.at_frontier()
    where = (
        f" while {ranks_text(left)} waited in {f['op']} #{f['seq']} on group {f['group']}"
        if left and s.frontier
        else ""
    )
    where = where or (f" while {ranks_text(left)} waited" if left else "")
    return Diagnosis(
        Verdict.DEAD,
        dead,
        [r for r in s.waiting if r not in dead],
        f"{ranks_text(dead)} died without a clean exit (last step {last}){where}",
        **f,
    )


def _peer_address(error: str) -> str:
    """The peer a lost connection names ("... by peer [10.0.0.2]:1234"), or ''."""
    match = re.search(r"peer \[?([0-9A-Fa-f.:]+?)\]?:\d+", error)
    return match.group(1) if match else ""


def _check_peer_lost(s: Stall) -> Diagnosis | None:
    """Ranks seen here lost their connection to a peer, and the ranks they lost left nothing
    to read: another node that went away (power, network, its agent killed). The victims are
    not the culprits, nor is a rank of theirs that vanished meanwhile without a word (its agent
    tearing the attempt down kills what does not stop in time); the ranks no node answered
    for are. Asked before `dead`: with every rank in sight it says nothing."""
    victims = sorted(r for r, t in s.tails.items() if _lost_a_peer(t))
    gone = sorted(set(range(s.world)) - set(s.tails))
    if not victims or not gone:
        return None
    addresses = sorted({a for r in victims if (a := _peer_address(s.tails[r].last_error))})
    at = f" at {', '.join(addresses)}" if addresses else ""
    step = max(s.tails[r].step for r in victims)
    silent = sorted(
        r for r, t in s.tails.items() if r not in victims and not t.left and s.alive.get(r) is False
    )
    also = f"; {ranks_text(silent)} here vanished meanwhile (torn down with the attempt)" if silent else ""
    return Diagnosis(
        Verdict.DEAD,
        gone,
        victims,
        f"{ranks_text(victims)} lost the connection to a peer{at} at step {step}; {ranks_text(gone)} "
        f"left nothing to read and did not answer (their node is gone: power, network or its agent){also}",
        evidence={"unseen_ranks": gone, "peer_addresses": addresses, "vanished_here": silent},
    )


def _check_clean_end(s: Stall) -> Diagnosis | None:
    """Every rank of the job closed its flight log without an error: the run ended, nothing hung
    (a post-mortem of a finished run must not invent a hang)."""
    if not s.tails or not all(t.closed and not t.last_error for t in s.tails.values()):
        return None
    unseen = sorted(set(range(s.world)) - set(s.tails))
    elsewhere = f"; {ranks_text(unseen)} not seen here (another node)" if unseen else ""
    return Diagnosis(
        Verdict.NONE,
        [],
        [],
        f"no hang: {ranks_text(s.tails)} ended the run cleanly, flight logs closed{elsewhere}",
    )


def _check_all_done(s: Stall) -> Diagnosis | None:
    """A post-mortem (no stacks, no liveness) where every collective completed and matched:
    these records show no hang (the job may have stopped in compute, or been stopped)."""
    if s.frontier is not None or s.stacks or s.alive:
        return None
    return Diagnosis(
        Verdict.NONE,
        [],
        [],
        "no hang in these records: every collective completed and matched on every rank "
        f"({ranks_text(s.tails)}); whatever stopped the job was not a collective",
    )


def _check_no_collective(s: Stall) -> Diagnosis | None:
    """Nobody is in a collective and nobody progresses: compute or input everywhere."""
    if s.frontier is not None:
        return None
    places = "; ".join(f"rank {r} {where(None, s.stacks.get(r))}" for r in sorted(s.tails))
    return Diagnosis(
        Verdict.COMPUTE,
        sorted(s.tails),
        [],
        f"no rank is in a collective and none progresses: all are stuck in compute or input ({places})",
    )


def _check_roots(s: Stall) -> Diagnosis | None:
    """The ranks at the roots of the wait-for graph: each never entered the op others wait in
    (in compute, elsewhere, without a log, or skipped it in a cycle), and every other stuck
    rank waits on one of them (`watchdog.waitgraph`)."""
    roots = s.graph.roots
    if not roots:
        return None
    culprits = s.graph.culprits
    tails, stacks = s.tails, s.stacks
    if all(root.unseen for root in roots):
        kind = Verdict.REMOTE
    elif all(
        not root.cycle and not root.skipped and stacks.get(root.rank) and not tails[root.rank].open_records()
        for root in roots
    ):
        kind = Verdict.COMPUTE
    else:
        kind = Verdict.MISSING
    first = next((r.waited_in.record for r in roots if r.waited_in is not None), None)
    return Diagnosis(
        kind,
        culprits,
        [r for r in s.graph.waiting() if r not in culprits],
        "; ".join(root_text(s.graph, s.tails, s.stacks, root) for root in roots),
        op=first.op,
        seq=first.seq,
        group=first.group,
        evidence={"unseen_ranks": sorted(r.rank for r in roots if r.unseen)}
        if kind == Verdict.REMOTE
        else {},
    )


def _check_undetermined(s: Stall) -> Diagnosis | None:
    """Ranks wait on each other in a cycle that nothing orders: no rank is named."""
    if not s.graph.undetermined:
        return None
    return Diagnosis(
        Verdict.UNDETERMINED,
        [],
        s.graph.waiting() or sorted(s.graph.waits),
        f"undetermined: {s.graph.undetermined}",
        **s.at_frontier(),
    )


def _check_not_started(s: Stall) -> Diagnosis | None:
    """Everyone entered it, but on some ranks the device never began it (a Flight Recorder's
    "scheduled" beside its peers' "started"): their device is busy with earlier work, or stuck."""
    group, seq, _, _ = s.frontier
    states = {r: rec.state for r in s.waiting if (rec := s.tails[r].record(group, seq)) is not None}
    started = sorted(r for r, state in states.items() if state == "started")
    scheduled = sorted(r for r, state in states.items() if state == "issued")
    if not started or not scheduled:
        return None
    f = s.at_frontier()
    return Diagnosis(
        Verdict.STUCK,
        scheduled,
        started,
        f"every rank of group {f['group']} issued {f['op']} #{f['seq']}; {ranks_text(started)} started it "
        f"on the device, {ranks_text(scheduled)} never did (scheduled only): "
        f"{'its' if len(scheduled) == 1 else 'their'} device is still busy with earlier work, or stuck",
        **f,
    )


def _check_stuck(s: Stall) -> Diagnosis | None:
    """Everyone entered it and it does not complete."""
    f = s.at_frontier()
    return Diagnosis(
        Verdict.STUCK,
        [],
        s.waiting,
        f"every rank of group {f['group']} entered {f['op']} #{f['seq']} and it does not complete: "
        "the transport or a device is at fault, not a rank's code",
        **f,
    )


# Asked in order; the first verdict wins (the last always answers).
CHECKS: list[Callable[[Stall], Diagnosis | None]] = [
    _check_clean_end,
    _check_shifted,
    _check_mismatch,
    _check_desync,
    _check_error,
    _check_peer_lost,
    _check_dead,
    _check_all_done,
    _check_no_collective,
    _check_roots,
    _check_undetermined,
    _check_not_started,
    _check_stuck,
]


def diagnose(
    tails: dict[int, FlightTail],
    world: int,
    *,
    alive: dict[int, bool] | None = None,
    stacks: dict[int, list[str]] | None = None,
) -> Diagnosis:
    """Explain a stall from every rank's flight-log tail, liveness and stacks (module doc)."""
    frontier = _frontier(tails)
    steps = [r.step for t in tails.values() for r in t.open_records() if r.step >= 0]
    reference = _reference_order(tails, min(steps)) if steps else []
    graph = waitgraph.build(tails, world, reference, post_mortem=not stacks and not alive)
    stall = Stall(tails, world, alive or {}, stacks or {}, frontier, graph)
    diag = next(d for check in CHECKS if (d := check(stall)) is not None)
    if diag.kind in (Verdict.DESYNC, Verdict.MISMATCH):
        _add_other_roots(stall, diag)
    diag.stacks = dict(stall.stacks)
    # what said "completed": the host, device events, or the backend's own Flight Recorder
    diag.evidence.setdefault("source", ", ".join(sorted({t.clock for t in stall.tails.values()})))
    stuck = stuck_groups(graph)
    if len(stuck) > 1:
        diag.evidence["stuck_groups"] = stuck
    return diag


def _add_other_roots(s: Stall, diag: Diagnosis) -> None:
    """A signature verdict names the ranks whose records disagree; a second fault elsewhere
    (a rank in compute, one that skipped an op others wait in) is a root of the wait-for graph
    and named beside it. A cycle ordered by time alone is not added: a desync makes cycles."""
    others = [
        root
        for root in s.graph.roots
        if root.rank not in diag.culprit_ranks and not (root.cycle and not root.skipped)
    ]
    if not others:
        return
    diag.culprit_ranks = sorted({*diag.culprit_ranks, *(root.rank for root in others)})
    diag.waiting_ranks = [r for r in diag.waiting_ranks if r not in diag.culprit_ranks]
    diag.why += "; also " + "; ".join(root_text(s.graph, s.tails, s.stacks, root) for root in others)
