"""The diagnosis of a stall: a pure function of every rank's flight-log tail, liveness and
stacks. `CHECKS` are asked in order; the first that recognises the picture gives the verdict:

1. **mismatch**: ranks that issued the same collective (group, sequence number) with a
   different op, shape or dtype than the others, or all-to-all split sizes that do not pair
   up (rank i sends rank j what j does not expect);
2. **desync**: the same sequence number issued at different training steps: a rank skipped a
   collective earlier and has been pairing with the wrong partner since;
3. **error** / **dead**: a rank that raised while peers wait; ranks whose peers lost the
   connection to them and who left nothing to read (a node gone); a rank that vanished;
4. **none** (a post-mortem without stacks): every collective completed and matched;
5. **compute** (everywhere): no rank is in a collective and none progresses;
6. **remote**: every rank seen here entered it; the ones behind are another node's (or left
   no dump);
7. **missing** / **compute**: ranks that never entered the collective the others wait in,
   and where they are instead (another collective, or compute per their stack);
8. **stuck**: everyone entered it: the ranks whose device never started it (a Flight
   Recorder's "scheduled" beside "started") when the dump says so, else the transport or a
   device, no rank's code.

Mismatch and desync read only the records (`watchdog.signatures`). `diagnose_groups` adds
every process group that is stuck on its own."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from meshscope.collector.flightread import (
    ASYNC_P2P_OPS,
    FlightTail,
)
from meshscope.collector.stacks import own_frame
from meshscope.watchdog.signatures import desync, group_members, mismatch, ranks_text
from meshscope.watchdog.verdicts import Diagnosis, Verdict

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


def _where(tail: FlightTail | None, stack: list[str] | None) -> str:
    """Where a rank is: the innermost frame of its main thread, and the collectives it has in
    flight (an async one in flight is not necessarily where it blocks)."""
    opened = tail.open_records() if tail is not None else []
    flying = ", ".join(f"{r.op} #{r.seq} on group {r.group} from {r.site}" for r in opened[-2:])
    if stack:  # the innermost frame of its own code: the library frames under it say only how
        return f"at {own_frame(stack)}" + (
            f" with {flying} in flight" if flying else " (no collective in flight)"
        )
    if flying:
        return f"with {flying} in flight"
    return "somewhere unknown (no stack, no collective in flight)"


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
    group: str | None = None  # judging one stuck group of several (`diagnose_groups`)

    def judged_tails(self) -> dict[int, FlightTail]:
        """The tails the signature checks compare: one group's records when judging one."""
        if self.group is None:
            return self.tails
        return {
            r: replace(t, records=[x for x in t.records if x.group == self.group])
            for r, t in self.tails.items()
        }

    @property
    def waiting(self) -> list[int]:
        """The ranks waiting in the frontier collective."""
        return self.frontier[3] if self.frontier else []

    def at_frontier(self) -> dict[str, Any]:
        """op, seq and group of the frontier collective (all None without one)."""
        group, seq, op, _ = self.frontier or (None, None, None, None)
        return {"op": op, "seq": seq, "group": group}


def _check_mismatch(s: Stall) -> Diagnosis | None:
    return mismatch(s.judged_tails(), s.world)


def _check_desync(s: Stall) -> Diagnosis | None:
    return desync(s.judged_tails(), s.world)


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
    places = "; ".join(f"rank {r} {_where(None, s.stacks.get(r))}" for r in sorted(s.tails))
    return Diagnosis(
        Verdict.COMPUTE,
        sorted(s.tails),
        [],
        f"no rank is in a collective and none progresses: all are stuck in compute or input ({places})",
    )


def _members_behind(s: Stall) -> tuple[list[int], list[int]]:
    """Members of the frontier's group: (unseen here, seen but never entered it)."""
    group, seq, _, _ = s.frontier
    members = group_members(s.tails, group, s.world)
    unseen = [r for r in members if r not in s.tails]  # another node's, not shared with us
    absent = [r for r in members if r in s.tails and s.tails[r].last_seq(group) < seq]
    return unseen, absent


def _check_remote(s: Stall) -> Diagnosis | None:
    """Everyone seen here entered it: one of the ranks this node cannot see is behind."""
    unseen, absent = _members_behind(s)
    if absent or not unseen:
        return None
    f = s.at_frontier()
    return Diagnosis(
        Verdict.REMOTE,
        unseen,
        s.waiting,
        f"every rank seen here entered {f['op']} #{f['seq']} on group {f['group']}; {ranks_text(unseen)} "
        "left nothing to read here (another node's ranks, or no dump): one of them is behind",
        **f,
        evidence={"unseen_ranks": unseen},
    )


def _check_absent(s: Stall) -> Diagnosis | None:
    """Ranks that never entered the collective the others wait in, and where they are."""
    _, absent = _members_behind(s)
    if not absent:
        return None
    # compute: its stack shows it outside any collective; without a stack (a post-mortem)
    # or with a collective in flight elsewhere it is only known to be missing
    tails, stacks = s.tails, s.stacks
    in_compute = all(stacks.get(r) and not (tails.get(r) and tails[r].open_records()) for r in absent)
    places = "; ".join(f"rank {r} is {_where(tails.get(r), stacks.get(r))}" for r in absent)
    f = s.at_frontier()
    return Diagnosis(
        Verdict.COMPUTE if in_compute else Verdict.MISSING,
        absent,
        s.waiting,
        f"{ranks_text(absent)} never entered {f['op']} #{f['seq']} on group {f['group']} that "
        f"{ranks_text(s.waiting)} {'waits' if len(s.waiting) == 1 else 'wait'} in ({places})",
        **f,
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
    _check_mismatch,
    _check_desync,
    _check_error,
    _check_peer_lost,
    _check_dead,
    _check_all_done,
    _check_no_collective,
    _check_remote,
    _check_absent,
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
    stall = Stall(tails, world, alive or {}, stacks or {}, _frontier(tails))
    return _judge(stall)


def _judge(stall: Stall) -> Diagnosis:
    diag = next(d for check in CHECKS if (d := check(stall)) is not None)
    diag.stacks = dict(stall.stacks)
    # what said "completed": the host, device events, or the backend's own Flight Recorder
    diag.evidence.setdefault("source", ", ".join(sorted({t.clock for t in stall.tails.values()})))
    return diag


def diagnose_groups(
    tails: dict[int, FlightTail],
    world: int,
    *,
    alive: dict[int, bool] | None = None,
    stacks: dict[int, list[str]] | None = None,
) -> Diagnosis:
    """`diagnose`, and every process group that is stuck on its own: a large job (data and
    expert parallel groups) can hang in several groups at once with different culprits. A
    group is stuck *because of another* when all of its culprits wait in that other group's
    collective; the independent ones are reported, each with all its culprits, in the
    `stuck_groups` evidence, and their culprits together are the verdict's."""
    overall = diagnose(tails, world, alive=alive, stacks=stacks)
    groups = sorted({r.group for t in tails.values() for r in t.open_records() if r.op not in ASYNC_P2P_OPS})
    if len(groups) < 2:
        return overall
    per_group = {
        g: _judge(Stall(tails, world, alive or {}, stacks or {}, _frontier(tails, g), group=g))
        for g in groups
    }
    waiting_in = {g: set(d.waiting_ranks) for g, d in per_group.items()}
    independent = [
        g
        for g, d in per_group.items()
        if not d.culprit_ranks or not any(set(d.culprit_ranks) <= waiting_in[h] for h in groups if h != g)
    ] or groups
    overall.evidence["stuck_groups"] = [
        {
            "group": g,
            "type": d.kind.value,
            "op": d.op,
            "seq": d.seq,
            "culprit_ranks": d.culprit_ranks,
            "waiting_ranks": d.waiting_ranks,
            "independent": g in independent,
            "why": d.why,
        }
        for g, d in per_group.items()
    ]
    if len(independent) > 1:
        overall.culprit_ranks = sorted({r for g in independent for r in per_group[g].culprit_ranks})
        overall.why = "; ".join(f"group {g}: {per_group[g].why}" for g in independent)
    return overall
