"""Signature checks of a stall, apart from the picture of who waits where: collectives whose
op, shape, dtype or all-to-all splits differ between ranks (mismatch), and ranks that pair
collectives of different steps (desync). Both read only the records, so they judge a live
stall and a post-mortem alike."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from meshscope.collector.flightread import FlightRecord, FlightTail
from meshscope.watchdog.verdicts import Diagnosis, Verdict

ALL_TO_ALL = ("all_to_all", "all_to_all_single")


def ranks_text(ranks: Any) -> str:
    """How a reason names ranks: "rank 3", "ranks 1, 2"."""
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def group_members(tails: dict[int, FlightTail], group: str, world: int) -> list[int]:
    """The ranks of `group` as some rank recorded them (all ranks when none did)."""
    for tail in tails.values():
        if group in tail.groups:
            return list(tail.groups[group])
    return list(range(world))


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
            if send is None or expect is None:
                continue
            if i == j:  # what a rank sends itself must be what it expects from itself: one that
                pi = members.index(i)  # disagrees with itself miscounted (two ranks have no majority)
                if pi < min(len(send), len(expect)) and send[pi] != expect[pi]:
                    blame[i] += 1
                continue
            pi, pj = members.index(i), members.index(j)
            if pj < len(send) and pi < len(expect) and send[pj] != expect[pi]:
                blame[i] += 1
                blame[j] += 1
    if not blame:
        return []
    top = max(blame.values())
    return sorted(r for r, n in blame.items() if n == top)


def mismatch(tails: dict[int, FlightTail], world: int) -> Diagnosis | None:
    """The earliest collective whose signature differs between ranks."""
    found: list[tuple[float, Diagnosis]] = []
    by_key: dict[tuple[str, int], dict[int, FlightRecord]] = {}
    for rank, tail in tails.items():
        for r in tail.records:
            if not r.p2p:
                by_key.setdefault((r.group, r.seq), {})[rank] = r
    for (group, seq), records in by_key.items():
        if len(records) < 2:
            continue
        members = group_members(tails, group, world)
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
            f"{ranks_text(odd)} issued {sample.op} #{seq} on group {group} with "
            f"{_signature_text(sample)}"
            + (f" while {ranks_text(others)} issued {_signature_text(theirs)}" if theirs else "")
            + f" ({what} mismatch, at {sample.site})"
        )
        t = min(r.t_issue for r in records.values())
        found.append(
            (
                t,
                Diagnosis(
                    Verdict.MISMATCH,
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


def _broke_habit(seqs: dict[int, dict[int, FlightRecord]], steps: dict[int, int]) -> list[int]:
    """The ranks that issued more or fewer of the group's collectives than they usually do a
    step, between the steps the first unpaired collective was issued at: the one that skipped
    (or added) one, when there is no majority to tell. [] when both or neither did."""
    lo, hi = min(steps.values()), max(steps.values())
    broke = []
    for rank in steps:
        count = Counter(recs[rank].step for recs in seqs.values() if rank in recs)
        # the ring may cut the first and the last step short; the steps between them must all
        # use the group (a training-loop group, not a checkpoint's barriers every N steps)
        inner = [s for s in range(min(count) + 1, max(count)) if not lo <= s <= hi]
        if len(inner) < 3 or any(count.get(s, 0) == 0 for s in inner):
            return []
        habit, seen = Counter(count[s] for s in inner).most_common(1)[0]
        if seen < 0.8 * len(inner):
            return []  # no habit to break
        if any(count.get(s, 0) != habit for s in range(lo, hi + 1)):
            broke.append(rank)
    return sorted(broke) if 0 < len(broke) < len(steps) else []


def _desync_in(seqs: dict[int, dict[int, FlightRecord]]) -> tuple | None:
    """In one group: the first collective whose ranks pair records of different steps, when
    the group was in step before and stays out of step the same way over two later steps."""
    order = sorted(seqs)
    agreed = False
    for i, seq in enumerate(order):
        records = seqs[seq]
        steps = {rank: r.step for rank, r in records.items()}
        usual, odd = _majority(steps)
        by_habit = not odd and len(set(steps.values())) > 1
        if by_habit:  # no majority (two ranks): the rank that broke its own habit
            odd = _broke_habit(seqs, steps)
            usual = next((steps[r] for r in steps if r not in odd), usual)
        if not odd:
            agreed = agreed or len(records) > 1
            continue
        if not agreed:
            return None  # never in step: not a training-loop group
        offset = {r: steps[r] - usual for r in odd}
        later = [seqs[k] for k in order[i + 1 :] if len(seqs[k]) > 1]
        # ...over steps to come, not one burst (a checkpoint's two barriers)
        spans_steps = len({rec.step for recs in later for q, rec in recs.items() if q not in odd}) >= 2
        persistent = spans_steps and all(
            r not in recs or recs[r].step - _majority({q: x.step for q, x in recs.items()})[0] == offset[r]
            for recs in later
            for r in odd
        )
        # a broken habit is itself the evidence that lasts: a group issued every step, one rank
        # issued one more or fewer than it always does
        found = persistent or by_habit
        return (min(r.t_issue for r in records.values()), seq, records, steps, odd) if found else None
    return None


def desync(tails: dict[int, FlightTail], world: int) -> Diagnosis | None:
    """Ranks pairing collectives of different steps: one skipped a collective earlier.

    Credible only when the group was in step before (a matching sequence number earlier) and
    stays out of step after, the same way, over at least two later steps: a group used off
    the training loop (a background checkpoint's barriers) matches or not by timing alone."""
    by_group: dict[str, dict[int, dict[int, FlightRecord]]] = {}
    for rank, tail in tails.items():
        for r in tail.records:
            if r.step >= 0 and not r.p2p:
                by_group.setdefault(r.group, {}).setdefault(r.seq, {})[rank] = r
    found = [(f, group) for group, seqs in by_group.items() if (f := _desync_in(seqs)) is not None]
    if not found:
        return None
    (_, seq, records, steps, odd), group = min(found, key=lambda f: f[0][0])
    others = [r for r in records if r not in odd]
    first = min(steps[r] for r in others)
    since = min(first, steps[odd[0]])
    one = len(odd) == 1
    skipped = any(steps[r] > first for r in odd)
    what = "skipped a collective" if skipped else "issued an extra collective"
    site = records[others[0]].site if skipped else records[odd[0]].site
    return Diagnosis(
        Verdict.DESYNC,
        odd,
        others,
        f"{ranks_text(odd)} issued {records[odd[0]].op} #{seq} on group {group} at step "
        f"{steps[odd[0]]} while {ranks_text(others)} did at step {first}: {'it' if one else 'they'} "
        f"{what} around step {since} ({site}) and {'has' if one else 'have'} paired with the wrong "
        "partner since",
        op=records[odd[0]].op,
        seq=seq,
        group=group,
        evidence={"desync_since_step": since, "skipped_site" if skipped else "extra_site": site},
    )


def _sites(tail: FlightTail, group: str) -> dict[int, str]:
    """Collective number -> call site, on one group, where the site is known."""
    return {r.seq: r.site for r in tail.records if r.group == group and not r.p2p and r.site not in ("", "?")}


def _follows(by_seq: dict[int, str], first: str, then: str) -> bool:
    """This rank's own history on the group issued `then` right after `first`."""
    return any(site == first and by_seq.get(seq + 1) == then for seq, site in by_seq.items())


def _agreement(sites: dict[int, dict[int, str]], ahead: list[int], rest: list[int], seq: int) -> int:
    """How many numbers from #seq on the ranks `ahead` issued from the site the others issued
    one number later, before the first that contradicts it or the records end."""
    n = 0
    while True:
        pairs = [(sites[a].get(seq + n), sites[r].get(seq + n + 1)) for a in ahead for r in rest]
        known = [(mine, theirs) for mine, theirs in pairs if mine is not None and theirs is not None]
        if not known or any(mine != theirs for mine, theirs in known):
            return n
        n += 1


def _shifted_in(
    sites: dict[int, dict[int, str]], changed_at: Callable[[int], set[int]] = lambda seq: set()
) -> tuple[int, list[int], list[int]] | None:
    """In one group: the first number where ranks issued it from different call sites and some
    ranks' site is the others' next one: (seq, ranks one ahead, the others). "Next" is what the
    others issue as #s+1, or, before they get there (a rank that crashed on the pairing), what
    their own history always issued right after their #s's site. A loop that alternates two
    sites (an all-to-all out and back) fits a shift either way at first: the shift that the
    later records keep fitting longer is the one; on a tie, the ranks whose #s left their own
    habit (`changed_at`: another site than at the same place of the step before) are the ones
    ahead; else no verdict."""
    seqs = sorted({s for by_seq in sites.values() for s in by_seq})
    for seq in seqs:
        here = {r: by_seq[seq] for r, by_seq in sites.items() if seq in by_seq}
        if len(set(here.values())) < 2:
            continue
        fits = []
        for site in sorted(set(here.values())):
            ahead = sorted(r for r, x in here.items() if x == site)
            rest = sorted(r for r in here if r not in ahead)
            theirs = {here[r] for r in rest}
            never = all(sites[a].get(seq - 1) not in theirs for a in ahead)
            nxt = [sites[r][seq + 1] == site for r in rest if seq + 1 in sites[r]]
            if nxt:
                later = all(nxt)
            else:  # nobody got to #s+1: their history says what comes after their #s
                later = all(_follows(sites[r], here[r], site) for r in rest)
            if later and never and len(ahead) < len(here):
                fits.append((_agreement(sites, ahead, rest, seq), ahead, rest))
        fits.sort(key=lambda f: -f[0])
        if not fits:
            return None
        tied = [f for f in fits if f[0] == fits[0][0]]
        if len(tied) > 1:
            changed = changed_at(seq)
            tied = [f for f in tied if set(f[1]) <= changed and not set(f[2]) & changed]
        return (seq, tied[0][1], tied[0][2]) if len(tied) == 1 else None
    return None


def shifted(tails: dict[int, FlightTail], world: int) -> Diagnosis | None:
    """Ranks that skipped a collective and paired the next one with their peers' skipped one:
    on one group, number #s was issued from call site A by the ranks one ahead and from B by
    the others, who issue A as #s+1. Their op, shape and dtype may match (the wire pairs them
    silently), so only the call sites tell. Read from any log with call sites (a Flight
    Recorder dump's frames, meshscope's records), without steps."""
    groups = {r.group for t in tails.values() for r in t.records if not r.p2p}
    found = []
    for group in sorted(groups):
        sites = {rank: by_seq for rank, t in tails.items() if (by_seq := _sites(t, group))}
        hit = _shifted_in(sites, _habit_breakers(tails, group)) if len(sites) > 1 else None
        if hit is not None:
            seq, ahead, rest = hit
            t = min(r.t_issue for rank in (*ahead, *rest) if (r := tails[rank].record(group, seq)))
            found.append((t, group, seq, ahead, rest))
    if not found:
        return None
    parts = [_shift_text(tails, group, seq, ahead, rest) for _, group, seq, ahead, rest in sorted(found)]
    _, group, seq, ahead, rest = min(found)
    culprits = sorted({r for *_, a, _ in found for r in a})
    theirs = tails[rest[0]].record(group, seq)
    return Diagnosis(
        Verdict.DESYNC,
        culprits,
        sorted({r for *_, rs in found for r in rs} - set(culprits)),
        "; ".join(parts),
        op=theirs.op,
        seq=seq,
        group=group,
        evidence={"skipped_site": theirs.site},
    )


def _habit_breakers(tails: dict[int, FlightTail], group: str) -> Callable[[int], set[int]]:
    """seq -> the ranks whose #seq on `group` came from another call site than the collective
    at the same place of their previous step (records with steps only)."""

    def at(seq: int) -> set[int]:
        out = set()
        for rank, tail in tails.items():
            rec = tail.record(group, seq)
            before = _same_place_before(tail, rec) if rec is not None and rec.step is not None else None
            if before is not None and before.site not in ("", "?") and before.site != rec.site:
                out.add(rank)
        return out

    return at


def _shift_text(tails: dict[int, FlightTail], group: str, seq: int, ahead: list[int], rest: list[int]) -> str:
    mine, theirs = tails[ahead[0]].record(group, seq), tails[rest[0]].record(group, seq)
    one = len(ahead) == 1
    return (
        f"{ranks_text(ahead)} issued {mine.op} #{seq} on group {group} from {mine.site}, which "
        f"{ranks_text(rest)} issue{'s' if len(rest) == 1 else ''} as #{seq + 1}; {ranks_text(rest)} "
        f"issued #{seq} from {theirs.site}: {'it' if one else 'they'} skipped the collective at "
        f"{theirs.site} and {'has' if one else 'have'} paired with the wrong partner since"
    )
