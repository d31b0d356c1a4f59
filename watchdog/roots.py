"""What the roots of a stall's wait-for graph are said as: where a rank is, each culprit's
sentence (what it never entered, who waits there, where it is instead, who waits on it through
other ops), and every op ranks wait in (`stuck_groups`)."""

from __future__ import annotations

from typing import Any

from meshscope.collector.flightread import FlightTail
from meshscope.collector.stacks import own_frame
from meshscope.watchdog.signatures import ranks_text
from meshscope.watchdog.waitgraph import SEND_OPS, Root, Wait, WaitGraph, op_text


def where(tail: FlightTail | None, stack: list[str] | None) -> str:
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
    if tail is not None and tail.clock == "flight recorder" and any(r.p2p for r in tail.records):
        return "in nothing its dump records, though it records sends and receives: in compute"
    if tail is not None and tail.clock == "flight recorder":
        return (
            "in nothing its dump records: compute, or an op the backend does not record "
            "(gloo records no send/recv)"
        )
    return "somewhere unknown (no stack, no collective in flight)"


def _waiters_in(graph: WaitGraph, wait: Wait) -> list[int]:
    """The ranks waiting in the same op as `wait` (a collective: its group and number)."""
    r = wait.record
    return sorted(
        w.rank
        for w in graph.waits.values()
        if w.record.group == r.group and w.record.op == r.op and (r.p2p or w.record.seq == r.seq)
    )


def _never_entered(rank: int, w: Wait, waiters: list[int]) -> str:
    """ "rank 5 never entered all_reduce #7 on group 3 that rank 4 waits in", or for a send or
    receive "rank 9 waits in recv from rank 5 on group 18; rank 5 never posted the send"."""
    verb = "waits" if len(waiters) == 1 else "wait"
    if w.record.p2p:
        pair = "receive" if w.record.op in SEND_OPS else "send"
        return f"{ranks_text(waiters)} {verb} in {w.what}; rank {rank} never posted the matching {pair}"
    return f"rank {rank} never entered {w.what} that {ranks_text(waiters)} {verb} in"


def _idle_text(tail: FlightTail, rank: int) -> str:
    last = max(tail.records, key=lambda r: r.t_issue)
    return (
        f"rank {rank} has nothing in flight while the others wait (its last op, {op_text(last)} at "
        f"{last.site}, completed): it stopped outside any collective or send/receive, in compute"
    )


def root_text(
    graph: WaitGraph, tails: dict[int, FlightTail], stacks: dict[int, list[str]], root: Root
) -> str:
    """One culprit, said as a person would check it: what it never entered, who waits there,
    where it is instead, and who waits on it through other groups."""
    w = root.waited_in
    if w is None:
        return _idle_text(tails[root.rank], root.rank)
    waiters = [r for r in _waiters_in(graph, w) if root.rank in graph.waits[r].on]
    verb = "waits" if len(waiters) == 1 else "wait"
    if root.stray is not None:
        skipped = root.stray
        text = (
            f"rank {root.rank} skipped {op_text(skipped, numbered=False)} (its program always issues it "
            f"at {skipped.site} at this point) and went on to {w.what}, where it waits"
        )
    elif root.cycle or root.skipped:
        own = graph.waits[root.rank]
        text = (
            f"{_never_entered(root.rank, w, waiters)}: it went on to {own.what} (at {own.record.site}) "
            "and waits there for ranks that are still in the op it skipped"
        )
    elif root.unseen:
        text = (
            f"{ranks_text(waiters)} {verb} in {w.what} for rank {root.rank}, which left nothing to read "
            "here (another node's rank, or no dump)"
        )
    else:
        place = where(tails.get(root.rank), stacks.get(root.rank))
        text = f"{_never_entered(root.rank, w, waiters)} (rank {root.rank} is {place})"
    also = [
        w for w in graph.waits.values()
        if root.rank in w.on and w.rank not in waiters and w.rank not in graph.culprits
    ]  # fmt: skip
    if also:
        text += "; " + "; ".join(f"rank {w.rank} waits for it too, in {w.what}" for w in also[:3])
        text += f" and {len(also) - 3} more" if len(also) > 3 else ""
    direct = {w.rank for w in also} | set(waiters)
    through = [
        r
        for r in graph.waiting()
        if r not in direct and r not in graph.culprits and root.rank in graph.leads_to.get(r, [])
    ]
    if through:
        shown = "; ".join(f"rank {r} in {graph.waits[r].what}" for r in through[:3])
        more = f" and {len(through) - 3} more" if len(through) > 3 else ""
        verb = "waits" if len(through) == 1 else "wait"
        text += f"; {ranks_text(through)} {verb} on it through other ops ({shown}{more})"
    return text


def stuck_groups(graph: WaitGraph) -> list[dict[str, Any]]:
    """Every op ranks wait in, with whom they wait on and the culprits that wait leads to:
    `independent` marks the ones a culprit holds directly, the rest wait through them."""
    ops: dict[tuple, dict[str, Any]] = {}
    culprits = set(graph.culprits)
    for w in graph.waits.values():
        r = w.record
        key = (r.group, r.op, -1 if r.p2p else r.seq)
        op = ops.setdefault(
            key,
            {"group": r.group, "op": r.op, "seq": None if r.p2p else r.seq, "waiting_ranks": [],
             "waiting_on": set(), "culprit_ranks": set(), "independent": False},
        )  # fmt: skip
        op["waiting_ranks"].append(w.rank)
        op["waiting_on"].update(w.on)
        op["culprit_ranks"].update(graph.leads_to.get(w.rank, []))
        op["independent"] = op["independent"] or bool(culprits & set(w.on))
    return [
        {**op, "waiting_on": sorted(op["waiting_on"]), "culprit_ranks": sorted(op["culprit_ranks"])}
        for op in ops.values()
    ]
