"""The wait-for graph of a stall, across every process group: who waits on whom, and the ranks
at its roots. The live watchdog and every post-mortem (meshscope's flight logs, PyTorch Flight
Recorder dumps) judge a stall on this one graph.

Each rank waits in at most one op: its oldest collective in flight (point-to-point ops count
where the log names them blocking: a Flight Recorder's send/recv, meshscope's send/recv).
- In a collective of group g, #s, it waits on the members of g that never entered #s. Members
  are the rank's own view of g (two groups made by `split_group` may share a name).
- In a send or receive, it waits on its peer unless the peer has the matching op in flight:
  point-to-point traffic is paired per (group, sender, receiver), never by a group-wide number,
  which counts every peer's traffic together.

Edges run from a waiting rank to the ranks it waits on. The culprits are at the roots:
- a rank some wait reaches that waits on nobody (in compute, in an op the log does not record,
  dead, or without a log at all);
- in a cycle with no way out (each waits on the next: a rank skipped a collective and went on
  to another group's), the wait earliest in the program (step, then call site in the order
  the ranks ran the previous step alike, then start time) is the one that was skipped: the
  ranks it waits on are the culprits. When nothing orders the cycle, it is undetermined.
Every other stuck wait is "waiting on" a root, never a culprit of its own. A wait whose every
member entered (`on` empty) is no rank's doing: transport or device (see `watchdog.diagnose`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from meshscope.collector.flightread import ASYNC_P2P_OPS, FlightRecord, FlightTail

SEND_OPS = frozenset({"send", "isend"})
RECV_OPS = frozenset({"recv", "irecv"})
# a wait started this much before another is earlier whatever the clocks of two hosts say
CLOCK_MARGIN_S = 0.05


def members_of(tails: dict[int, FlightTail], rank: int, group: str, world: int) -> list[int]:
    """The ranks of `group` as `rank` knows it: its own record of the group, else another rank's
    record that lists it, else the ranks whose logs used a group of that name (the default
    group "0": the world). Flight Recorder dumps of gloo jobs list no groups at all."""
    own = tails[rank].groups.get(group) if rank in tails else None
    if own:
        return sorted(own)
    for tail in tails.values():
        listed = tail.groups.get(group)
        if listed and rank in listed:
            return sorted(listed)
    if group == "0":
        return list(range(world))
    return sorted(r for r, t in tails.items() if any(x.group == group for x in t.records))


def _same_group(tails: dict[int, FlightTail], member: int, group: str, members: list[int]) -> bool:
    """`member`'s group of that name is the same group (not a namesake of `split_group`)."""
    listed = tails[member].groups.get(group)
    return not listed or sorted(listed) == members


@dataclass(frozen=True)
class Wait:
    """One rank waiting in one op."""

    rank: int
    record: FlightRecord
    on: tuple[int, ...]  # the ranks it waits on (never entered it; p2p: never posted the match)
    unseen: tuple[int, ...]  # of those, ranks that left no log or dump

    @property
    def what(self) -> str:
        """How a reason names the op: "all_reduce #7 on group 3", "send to rank 5 on group 2"."""
        return op_text(self.record)


def op_text(r: FlightRecord, numbered: bool = True) -> str:
    """An op as a reason names it: "all_reduce #7 on group 3", "send to rank 5 on group 2"."""
    if r.p2p:
        to = "to" if r.op in SEND_OPS else "from"
        return f"{r.op} {to} rank {r.peer} on group {r.group}"
    return f"{r.op} #{r.seq} on group {r.group}" if numbered else f"{r.op} on group {r.group}"


def _posted_match(tail: FlightTail, rec: FlightRecord, rank: int) -> bool:
    """The peer has in flight the op that pairs with `rec` (a send with its receive)."""
    want = RECV_OPS if rec.op in SEND_OPS else SEND_OPS
    return any(r.op in want and r.group == rec.group and r.peer == rank for r in tail.open_records())


def _p2p_wait(tails: dict[int, FlightTail], rank: int, opened: list[FlightRecord]) -> Wait | None:
    """A rank whose ops in flight are all sends and receives waits on the peers that never
    posted the match (the first such op); when every peer did, on its oldest op, on nobody."""
    for rec in opened:
        if rec.peer < 0:
            continue
        if rec.peer not in tails:
            return Wait(rank, rec, (rec.peer,), (rec.peer,))
        if not _posted_match(tails[rec.peer], rec, rank):
            return Wait(rank, rec, (rec.peer,), ())
    return Wait(rank, opened[0], (), ()) if opened else None


def wait_of(tails: dict[int, FlightTail], rank: int, world: int) -> Wait | None:
    """The op `rank` waits in, with the ranks it waits on (None: it waits in nothing logged)."""
    opened = sorted(tails[rank].open_records(), key=lambda r: r.t_issue)
    collectives = [r for r in opened if not r.p2p]
    if not collectives:
        # meshscope's isend/irecv in flight are normal while a rank computes; a Flight
        # Recorder's send/recv (and meshscope's blocking ones) are where a rank waits
        return _p2p_wait(tails, rank, [r for r in opened if r.op not in ASYNC_P2P_OPS])
    rec = collectives[0]
    members = members_of(tails, rank, rec.group, world)
    on, unseen = [], []
    for m in members:
        if m == rank:
            continue
        if m not in tails:
            on.append(m)
            unseen.append(m)
        elif _same_group(tails, m, rec.group, members) and tails[m].last_seq(rec.group) < rec.seq:
            on.append(m)
    return Wait(rank, rec, tuple(on), tuple(unseen))


def _key(r: FlightRecord) -> tuple:
    """What a rank's program issues at one place: call site, op, group (and a send's or
    receive's peer)."""
    return (r.site, r.op, r.group, r.peer if r.p2p else -1)


def _pairs_with(skipped: FlightRecord, rank: int, wait: Wait) -> bool:
    """`skipped` (an op of `rank`) is the op `wait` waits for it in: the same collective place,
    or the send or receive that pairs with the waiter's."""
    theirs = wait.record
    if not theirs.p2p:
        return not skipped.p2p and _key(skipped)[:3] == _key(theirs)[:3]
    want = RECV_OPS if theirs.op in SEND_OPS else SEND_OPS
    return skipped.op in want and skipped.group == theirs.group and skipped.peer == wait.rank


def _deviations(tail: FlightTail, min_seen: int) -> list[tuple[int, FlightRecord]]:
    """Where a rank left its own program: at record j+1 it issued an op it knew (seen before)
    after an op its history always followed with another one (seen `min_seen` times or more),
    the one it skipped. (index j+1, the skipped op's last record). Needs call sites
    (meshscope's records, a dump's frames); a branch taken for the first time (an op every N
    steps) is not a skip."""
    records = sorted((r for r in tail.records if r.op not in ASYNC_P2P_OPS), key=lambda r: r.t_issue)
    keys = [_key(r) for r in records]
    if any(k[0] in ("", "?") for k in keys):
        return []
    out = []
    for j in range(len(keys) - 1):
        seen = [keys[i + 1] for i in range(j) if keys[i] == keys[j]]
        known = keys[j + 1] in keys[:j]
        if len(seen) < min_seen or len(set(seen)) != 1 or keys[j + 1] == seen[0] or not known:
            continue
        last = max(i for i in range(j + 1) if keys[i] == seen[0])
        out.append((j + 1, records[last]))
    return out


def skipped_by(tail: FlightTail, rank: int, wait: Wait) -> bool:
    """`rank` skipped the op `wait` waits for it in: it left its program there (`_deviations`,
    one earlier pass through that place is enough: the waiter corroborates it) after it last
    issued that op."""
    records = sorted((r for r in tail.records if r.op not in ASYNC_P2P_OPS), key=lambda r: r.t_issue)
    places = [i for i, r in enumerate(records) if _pairs_with(r, rank, wait)]
    return bool(places) and any(
        j > places[-1] and _key(rec) == _key(records[places[-1]]) for j, rec in _deviations(tail, 1)
    )


def stray(tail: FlightTail) -> FlightRecord | None:
    """The op a waiting rank skipped right before the op it waits in (its last step was a
    deviation from its program, seen twice before: nobody corroborates it), whoever waits for
    it: None when it did not."""
    records = sorted((r for r in tail.records if r.op not in ASYNC_P2P_OPS), key=lambda r: r.t_issue)
    found = [rec for j, rec in _deviations(tail, 2) if j == len(records) - 1]
    return found[0] if found and records[-1].state in ("issued", "started") else None


def _skipped(tails: dict[int, FlightTail], waits: dict[int, Wait]) -> dict[int, Wait]:
    """Ranks that skipped the op another rank waits for them in, and went on to wait elsewhere.
    rank -> the earliest wait they left waiting."""
    out: dict[int, Wait] = {}
    for w in sorted(waits.values(), key=lambda w: w.record.t_issue):
        for r in w.on:
            if r not in out and r in waits and skipped_by(tails[r], r, w):
                out[r] = w
    return out


@dataclass
class Root:
    """A culprit of the stall: a rank that waits on nobody, or the skipper in a cycle."""

    rank: int
    waited_in: Wait | None  # the earliest wait that waits on it directly (None: idle)
    cycle: tuple[int, ...] = ()  # the ranks of the cycle it closes (empty: a free rank)
    skipped: bool = False  # its own history puts it in `waited_in`'s op, and it went on
    stray: FlightRecord | None = None  # the op it skipped right before its own wait (nobody's)
    idle: bool = False  # nobody waits on it, and it issued nothing while the job stood still

    @property
    def unseen(self) -> bool:
        """It left no log or dump: only its peers' records speak of it."""
        return self.waited_in is not None and self.rank in self.waited_in.unseen


@dataclass
class WaitGraph:
    """Every rank's wait and the roots they lead to."""

    waits: dict[int, Wait]
    roots: list[Root] = field(default_factory=list)
    stuck: list[Wait] = field(default_factory=list)  # waits every member entered
    undetermined: str = ""  # why a cycle names no culprit
    leads_to: dict[int, list[int]] = field(default_factory=dict)  # waiting rank -> its culprits

    @property
    def culprits(self) -> list[int]:
        """The root ranks, once each."""
        return sorted({r.rank for r in self.roots})

    def waiting(self) -> list[int]:
        """Every rank that waits on a culprit, directly or through other waits."""
        return sorted(r for r, leads in self.leads_to.items() if leads)


def _program_place(waits: list[Wait], reference: list[str]) -> dict[int, tuple]:
    """Each wait's place in the program: its step, its call site's place in a step every rank
    ran alike (unknown: last), then its start."""
    places = {}
    for w in waits:
        r = w.record
        step = r.step if r.step >= 0 else float("inf")
        place = reference.index(r.site) if r.site in reference else float("inf")
        places[w.rank] = (step, place, r.t_issue)
    return places


def _skipped_in(cycle: list[Wait], reference: list[str]) -> tuple[Wait | None, str]:
    """The wait of a cycle that was skipped: the earliest in the program. None (with why) when
    neither the program nor the clocks order it."""
    places = _program_place(cycle, reference)
    ranked = sorted(cycle, key=lambda w: places[w.rank])
    first, second = ranked[0], ranked[1]
    a, b = places[first.rank], places[second.rank]
    if a[:2] < b[:2]:
        return first, ""
    if a[:2] == b[:2] and b[2] - a[2] > CLOCK_MARGIN_S and a[2] > 0:
        return first, ""
    return None, (
        f"ranks {', '.join(str(w.rank) for w in cycle)} each wait on another's op "
        f"({'; '.join(f'rank {w.rank} in {w.what}' for w in ranked)}) and nothing says which "
        "was skipped first"
    )


def _terminal_roots(
    graph: WaitGraph, dag: nx.DiGraph, node: int, skippers: dict[int, Wait], reference: list[str]
) -> list[int]:
    """The culprits of one strongly connected part of the graph with no way out (none for the
    others): a rank that waits on nobody, or the rank of a cycle that skipped an op another
    waits in, else the cycle's earliest wait's ranks; its roots go to `graph.roots`."""
    if dag.out_degree(node):
        return []
    waits = graph.waits
    ranks = sorted(dag.nodes[node]["members"])
    if len(ranks) == 1 and ranks[0] not in waits:  # waits on nobody: a root
        direct = sorted((w for w in waits.values() if ranks[0] in w.on), key=lambda w: w.record.t_issue)
        graph.roots.append(Root(ranks[0], direct[0]))
        return ranks
    if len(ranks) == 1:  # everyone entered its op: no rank's doing (see watchdog.diagnose)
        return []
    in_cycle = [r for r in ranks if r in skippers]
    if in_cycle:  # a rank of it skipped the op another waits for it in
        graph.roots.extend(Root(r, skippers[r], tuple(ranks), skipped=True) for r in in_cycle)
        return in_cycle
    skipped, why = _skipped_in([waits[r] for r in ranks], reference)
    if skipped is None:
        graph.undetermined = "; ".join(filter(None, (graph.undetermined, why)))
        return []
    blamed = [r for r in skipped.on if r in ranks]
    graph.roots.extend(Root(r, skipped, tuple(ranks)) for r in blamed)
    return blamed


def build(
    tails: dict[int, FlightTail], world: int, reference: list[str] | None = None, *, post_mortem: bool = False
) -> WaitGraph:
    """The wait-for graph of the ranks' logs, its roots and the cycles resolved (module doc).
    `reference`: call sites of one step in program order, to order a cycle's waits.
    `post_mortem`: no stacks say where a rank is; a rank with nothing in flight that nobody
    waits on is named too when the logs record sends and receives (so it cannot be in one)."""
    waits = {r: w for r in sorted(tails) if (w := wait_of(tails, r, world)) is not None}
    graph = WaitGraph(waits)
    g = nx.DiGraph()
    for w in waits.values():
        g.add_node(w.rank)
        g.add_edges_from((w.rank, on) for on in w.on)
    graph.stuck = [w for w in waits.values() if not w.on]
    dag = nx.condensation(g)
    skippers = _skipped(tails, waits)
    culprits_of = {node: _terminal_roots(graph, dag, node, skippers, reference or []) for node in dag.nodes}
    mapping = dag.graph["mapping"]
    for rank, wait in skippers.items():  # skipped, then went on to wait behind another fault
        node = mapping[rank]
        if rank not in culprits_of.get(node, []):
            graph.roots.append(Root(rank, wait, skipped=True))
            culprits_of.setdefault(node, []).append(rank)
    for rank, wait in waits.items():  # skipped an op nobody waits in, right before its wait
        node = mapping[rank]
        if rank not in culprits_of.get(node, []) and (rec := stray(tails[rank])) is not None:
            graph.roots.append(Root(rank, wait, stray=rec))
            culprits_of.setdefault(node, []).append(rank)
    if post_mortem and waits and any(r.p2p for t in tails.values() for r in t.records):
        named = {root.rank for root in graph.roots}
        for rank in sorted(set(tails) - set(waits) - named - set(mapping)):
            if tails[rank].records:  # stood still outside any op while everyone else waits
                graph.roots.append(Root(rank, None, idle=True))
    for rank in waits:
        reach = nx.descendants(dag, mapping[rank]) | {mapping[rank]}
        graph.leads_to[rank] = sorted({c for n in reach for c in culprits_of.get(n, [])})
    graph.roots.sort(key=lambda root: root.rank)
    return graph
