"""PyTorch Flight Recorder dumps, diagnosed like meshscope's own flight logs.

A job that never ran meshscope can still be explained after the fact: PyTorch's Flight
Recorder (`TORCH_FR_BUFFER_SIZE`, or `TORCH_NCCL_TRACE_BUFFER_SIZE` on older NCCL builds;
torch_npu's `TORCH_HCCL_TRACE_BUFFER_SIZE`, files `hccl_trace_rank_<R>`) dumps each rank's
ring of collectives to `<prefix><rank>` (pickle) or JSON. Each entry becomes a `FlightRecord`
(sequence number per process group, op, sizes, dtypes, device state, call site, a send's or
receive's peer as a global rank) and `watchdog.diagnose.diagnose` judges them on one wait-for
graph across every group: the ranks at its roots (never entered the op others wait in, skipped
it, or left no dump), every other stuck group as waiting on them, ranks whose device never
started the op, collectives paired across call sites, op/shape/dtype mismatches (inside a
coalesced block too), all-to-all split sizes when the dump lists per-peer tensors, and dumps
that show no hang at all. Gloo's recorder (torch 2.13) lists no send/recv and no group
members: a rank waiting in a receive looks idle there, and the verdict says so.

The op comes from `profiling_name` ("nccl:all_reduce"); HCCL dumps may leave it empty, and then
it is read from the Python frames (the `torch.distributed` function that issued it), else
from the shapes. Entries of one coalesced block share a sequence number and are judged as one
collective whose signature is all of theirs.

Dumps are pickles; they are read with an unpickler that refuses every class, so a dump can
hold only plain data (dicts, lists, strings, numbers) and a hostile file cannot run code.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from meshscope.collector.flightread import FlightRecord, FlightTail
from meshscope.watchdog.diagnose import diagnose
from meshscope.watchdog.verdicts import Diagnosis

_RANK = re.compile(r"^(.*?)(\d+)(\.json)?$")
_TORCH = ("/torch/distributed/", "/torch/nn/parallel/", "c10d_logger.py", "/torch_npu/", "/contextlib.py")
# a point-to-point entry's peers, in group ranks: "send 1->2" (from 1 to 2), "recv 3<-0" (3 from 0)
_P2P_NAME = re.compile(r"(?:send|recv)\s+(\d+)\s*(->|<-)\s*(\d+)")
# Backend op names (profiling_name after "nccl:"/"hccl:", c10d's Python names) -> meshscope's.
OP_NAMES = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "_allgather_base": "all_gather_into_tensor",
    "all_gather_single": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "reduce_scatter_base": "reduce_scatter_tensor",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all_single",
    "_broadcast_oop": "broadcast",
}
# torch.distributed functions that issue one collective: how a frame names the op.
C10D_OPS = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
        "broadcast",
        "reduce",
        "gather",
        "scatter",
        "barrier",
        "send",
        "recv",
        "isend",
        "irecv",
        "all_reduce_coalesced",
    }
)
# Flight Recorder device states -> flight-log states ("scheduled": not begun on the device).
STATES = {"scheduled": "issued", "started": "started", "completed": "completed"}


class DumpError(ValueError):
    """A file that is not a Flight Recorder dump; the message names it."""


class _PlainData(pickle.Unpickler):
    """Unpickles builtin containers and scalars only."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name}: a Flight Recorder dump holds plain data only"
        )


def load_dump(path: Path) -> dict[str, Any]:
    """One rank's dump (pickle or JSON) as plain data; DumpError when it is not one."""
    raw = Path(path).read_bytes()
    try:
        data = json.loads(raw) if raw[:1] in (b"{", b"[") else _PlainData(io.BytesIO(raw)).load()
    except (
        pickle.UnpicklingError,
        ValueError,
        EOFError,
        TypeError,
        IndexError,
        KeyError,
        AttributeError,
        OverflowError,
        MemoryError,
        RecursionError,
    ) as err:
        # a truncated or hostile pickle fails in many ways; none of them is ours to raise
        raise DumpError(f"{path}: not a Flight Recorder dump ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise DumpError(f"{path}: not a Flight Recorder dump (no 'entries' list)")
    return data


def _site(frames: Any, callers: int = 2) -> str:
    """The first frame outside torch and, after " < ", its callers (file:line), as meshscope's
    flight log names a call site (`collector.flightops.call_site`)."""
    own = [
        f
        for f in (frames if isinstance(frames, list) else [])
        if isinstance(f, dict) and not any(part in str(f.get("filename", "")) for part in _TORCH)
    ]
    if not own:
        return "?"
    first = own[0]
    filename = str(first.get("filename", ""))
    site = f"{'/'.join(filename.rsplit('/', 2)[-2:])}:{first.get('line')} {first.get('name')}"
    for f in own[1 : 1 + callers]:
        site += f" < {str(f.get('filename', '')).rsplit('/', 1)[-1]}:{f.get('line')}"
    return site


def _numel(size: Any) -> int:
    n = 1
    for d in size if isinstance(size, list) else []:
        n *= int(d)
    return n


def _op(entry: dict[str, Any]) -> str:
    """The op of an entry: its profiling name, else the c10d function in its frames, else what
    its shapes allow (HCCL dumps may carry no profiling name)."""
    name = str(entry.get("profiling_name") or "").split(":", 1)[-1].split(" ", 1)[0].strip()
    if not name:
        frames = entry.get("frames") if isinstance(entry.get("frames"), list) else []
        name = next(
            (str(f.get("name")) for f in frames if isinstance(f, dict) and str(f.get("name")) in C10D_OPS), ""
        )
    if not name:
        ins = sum(_numel(s) for s in entry.get("input_sizes") or [])
        outs = sum(_numel(s) for s in entry.get("output_sizes") or [])
        name = "all_gather" if outs > ins else "reduce_scatter" if ins > outs else "all_reduce"
    return OP_NAMES.get(name, name)


def to_record(entry: dict[str, Any]) -> FlightRecord:
    """A Flight Recorder entry as a meshscope flight record."""
    op = _op(entry)
    p2p = bool(entry.get("is_p2p"))
    sizes_in = entry.get("input_sizes") or []
    sizes_out = entry.get("output_sizes") or []
    splits = ""
    if op in ("all_to_all", "alltoall") and len(sizes_in) > 1:  # one tensor per peer
        splits = (
            f"in={','.join(str(_numel(s)) for s in sizes_in)} "
            f"out={','.join(str(_numel(s)) for s in sizes_out)}"
        )
    state = "completed" if entry.get("retired") else STATES.get(str(entry.get("state")), "issued")
    created = entry.get("time_created_ns") or 0
    finished = entry.get("time_discovered_completed_ns") or 0
    group = entry.get("process_group") or ("?", "")
    return FlightRecord(
        seq=int(entry.get("p2p_seq_id" if p2p else "collective_seq_id", -1) or 0),
        step=-1,
        t_issue=created / 1e9,
        t_done=finished / 1e9,
        group=str(group[0]),
        op=op,
        state=state,
        dtype=",".join(str(d).lower() for d in (entry.get("input_dtypes") or [])[:1]),
        shapes=";".join("x".join(map(str, s)) or "scalar" for s in sizes_in),
        splits=splits,
        site=_site(entry.get("frames")),
        peer=_local_peer(entry) if p2p else -1,  # a group rank until `_global_peers`
        group_size=0,
    )


def _local_peer(entry: dict[str, Any]) -> int:
    """The peer's group rank a send/recv names in its profiling name (-1: not named)."""
    match = _P2P_NAME.search(str(entry.get("profiling_name") or ""))
    return int(match.group(3)) if match else -1


def _global_peers(records: list[FlightRecord], groups: dict[str, list[int]]) -> list[FlightRecord]:
    """Peers as global ranks: a group rank is the place in the group's sorted ranks (as
    PyTorch's analyzer reads them); the default group's ranks are global already."""
    out = []
    for r in records:
        if r.p2p and r.peer >= 0 and r.group != "0":
            members = sorted(groups.get(r.group) or [])
            r = replace(r, peer=members[r.peer] if r.peer < len(members) else -1)
        out.append(r)
    return out


def _coalesced(records: list[FlightRecord]) -> list[FlightRecord]:
    """Entries of one coalesced block (same group and sequence number on one rank) as one
    record: its op lists the members, its shapes and dtypes are all of theirs."""
    blocks: dict[tuple[str, int, bool], list[FlightRecord]] = {}
    for r in records:
        blocks.setdefault((r.group, r.seq, r.p2p), []).append(r)
    out = []
    for (_, _, p2p), block in blocks.items():
        if len(block) == 1 or p2p:
            out.extend(block)
            continue
        members = [r for r in block if r.op != "coalesced"] or block
        states = {r.state for r in block}
        state = "completed" if states == {"completed"} else "started" if "started" in states else "issued"
        out.append(
            replace(
                members[0],
                op="coalesced[" + ",".join(r.op for r in members) + "]",
                shapes="|".join(r.shapes for r in members),
                dtype=",".join(dict.fromkeys(r.dtype for r in members)),
                state=state,
                t_issue=min(r.t_issue for r in block),
                t_done=max(r.t_done for r in block),
            )
        )
    return sorted(out, key=lambda r: r.t_issue)


def _groups(dump: dict[str, Any]) -> dict[str, list[int]]:
    out = {}
    for name, cfg in (dump.get("pg_config") or {}).items():
        try:
            ranks = cfg["ranks"]
            listed = json.loads(ranks) if isinstance(ranks, str) else list(ranks)
        except (KeyError, TypeError, ValueError):
            continue
        if listed:  # gloo groups dump one nameless entry with no ranks
            out[str(name)] = [int(r) for r in listed]
    return out


def dump_tail(path: Path, rank: int) -> FlightTail:
    """One rank's dump as a flight-log tail (DumpError when it is not one)."""
    dump = load_dump(path)
    groups = _groups(dump)
    records = _coalesced([to_record(e) for e in dump["entries"] if isinstance(e, dict)])
    records = _global_peers(records, groups)
    return FlightTail(
        Path(path),
        rank,
        0,
        -1,
        -1,
        0.0,
        0.0,
        0.0,
        False,
        "",
        0,
        clock="flight recorder",
        records=records,
        groups=groups,
    )


def read_dumps(folder: Path, prefix: str | None = None) -> dict[int, FlightTail]:
    """Every rank's dump in `folder` (files `<prefix><rank>`), as flight-log tails."""
    tails = {}
    for path in sorted(Path(folder).iterdir()):
        match = _RANK.match(path.name)
        if not path.is_file() or not match or (prefix is not None and match.group(1) != prefix):
            continue
        tails[int(match.group(2))] = dump_tail(path, int(match.group(2)))
    if not tails:
        raise DumpError(f"{folder}: no Flight Recorder dumps (files named <prefix><rank>)")
    world = _world(tails)
    for tail in tails.values():
        tail.world_size = world
    return tails


def recorder_verdict(paths: dict[int, Path], world: int) -> Diagnosis | None:
    """The diagnosis of live ranks' on-demand Flight Recorder dumps (None: none readable)."""
    tails = {}
    for rank, path in paths.items():
        try:
            tails[rank] = dump_tail(path, rank)
        except (DumpError, OSError):
            continue
    return diagnose(tails, world) if tails else None


def _world(tails: dict[int, FlightTail]) -> int:
    """The job's size: the largest rank any group lists (a dump may be missing), else the
    largest rank dumped."""
    ranks = [r for t in tails.values() for members in t.groups.values() for r in members]
    return max([*ranks, *tails]) + 1


def diagnose_dumps(folder: Path, prefix: str | None = None) -> Diagnosis:
    """The hang diagnosis of a job from its Flight Recorder dumps."""
    tails = read_dumps(folder, prefix)
    world = _world(tails)
    diag = diagnose(tails, world)
    missing = sorted(set(range(world)) - set(tails))
    if missing:
        diag.evidence["ranks_without_dump"] = missing
    return diag
