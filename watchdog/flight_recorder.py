"""PyTorch Flight Recorder dumps, diagnosed like meshscope's own flight logs.

A job that never ran meshscope can still be explained after the fact: PyTorch's Flight
Recorder (`TORCH_FR_BUFFER_SIZE`, or `TORCH_NCCL_TRACE_BUFFER_SIZE` on older NCCL builds)
dumps each rank's ring of collectives to `<prefix><rank>` (pickle) or JSON. Each entry becomes
a `FlightRecord` (sequence number per process group, op, sizes, dtypes, state, call site) and
`detectors.hang.diagnose` judges them: ranks that never entered the collective the others wait
in, op/shape/dtype mismatches, and all-to-all split sizes when the dump lists per-peer tensors.

Dumps are pickles; they are read with an unpickler that refuses every class, so a dump can
hold only plain data (dicts, lists, strings, numbers) and a hostile file cannot run code.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from pathlib import Path
from typing import Any

from meshscope.collector.flightread import FlightRecord, FlightTail
from meshscope.watchdog.diagnose import diagnose
from meshscope.watchdog.verdicts import Diagnosis

_RANK = re.compile(r"^(.*?)(\d+)(\.json)?$")
_TORCH = ("/torch/distributed/", "/torch/nn/parallel/", "c10d_logger.py")


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


def _site(frames: Any) -> str:
    for frame in frames if isinstance(frames, list) else []:
        filename = str(frame.get("filename", ""))
        if not any(part in filename for part in _TORCH):
            return f"{'/'.join(filename.rsplit('/', 2)[-2:])}:{frame.get('line')} {frame.get('name')}"
    return "?"


def _numel(size: Any) -> int:
    n = 1
    for d in size if isinstance(size, list) else []:
        n *= int(d)
    return n


def to_record(entry: dict[str, Any]) -> FlightRecord:
    """A Flight Recorder entry as a meshscope flight record."""
    op = str(entry.get("profiling_name", "?")).split(":", 1)[-1].split(" ", 1)[0]
    p2p = bool(entry.get("is_p2p"))
    sizes_in = entry.get("input_sizes") or []
    sizes_out = entry.get("output_sizes") or []
    splits = ""
    if op in ("all_to_all", "alltoall") and len(sizes_in) > 1:  # one tensor per peer
        splits = (
            f"in={','.join(str(_numel(s)) for s in sizes_in)} "
            f"out={','.join(str(_numel(s)) for s in sizes_out)}"
        )
    done = entry.get("state") == "completed" or bool(entry.get("retired"))
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
        state="completed" if done else "issued",
        dtype=",".join(str(d).lower() for d in (entry.get("input_dtypes") or [])[:1]),
        shapes=";".join("x".join(map(str, s)) or "scalar" for s in sizes_in),
        splits=splits,
        site=_site(entry.get("frames")),
        peer=-1,
        group_size=0,
    )


def _groups(dump: dict[str, Any]) -> dict[str, list[int]]:
    out = {}
    for name, cfg in (dump.get("pg_config") or {}).items():
        try:
            ranks = cfg["ranks"]
            out[str(name)] = json.loads(ranks) if isinstance(ranks, str) else list(ranks)
        except (KeyError, TypeError, ValueError):
            continue
    return out


def read_dumps(folder: Path, prefix: str | None = None) -> dict[int, FlightTail]:
    """Every rank's dump in `folder` (files `<prefix><rank>`), as flight-log tails."""
    tails = {}
    for path in sorted(Path(folder).iterdir()):
        match = _RANK.match(path.name)
        if not path.is_file() or not match or (prefix is not None and match.group(1) != prefix):
            continue
        dump = load_dump(path)
        rank = int(match.group(2))
        records = [to_record(e) for e in dump["entries"] if isinstance(e, dict)]
        records.sort(key=lambda r: r.t_issue)
        tails[rank] = FlightTail(
            path,
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
            groups=_groups(dump),
        )
    if not tails:
        raise DumpError(f"{folder}: no Flight Recorder dumps (files named <prefix><rank>)")
    world = max(tails) + 1
    for tail in tails.values():
        tail.world_size = world
    return tails


def diagnose_dumps(folder: Path, prefix: str | None = None) -> Diagnosis:
    """The hang diagnosis of a job from its Flight Recorder dumps."""
    tails = read_dumps(folder, prefix)
    diag = diagnose(tails, max(tails) + 1)
    missing = sorted(set(range(max(tails) + 1)) - set(tails))
    if missing:
        diag.evidence["ranks_without_dump"] = missing
    return diag
