"""Reading the collective flight log, and its on-disk format (said once, for the writer in
`flightlog` and every reader: the watchdog, `hang-report`, post-mortems). No torch needed: a
dead job's files are read from beside it.

A file is a 256-byte header and a ring of fixed-size records (see `HEADER` and `RECORD`)."""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAGIC = b"MSFLT2\0\0"
# magic, rank, world, pid, capacity, written, step (the host's), progress_t, started_t, step_s,
# state, attempt (torchrun's restart count), device_step, clock, last_error.
# On an accelerator `progress_t`, `step_s`, `device_step` and completion are the device's,
# from events the flight log's own thread queries (`clock` = CLOCK_DEVICE); on the host the
# host's own (CLOCK_HOST).
HEADER = struct.Struct("<8siiiiqqdddiiqi128s")
HEADER_SIZE = 256
# seq, step, t_issue, t_done, group, op, state, dtype, shapes, splits, site, peer, group_size
RECORD = struct.Struct("<qqdd16s24sb15s56s56s96sii")
RECORD_HEAD = struct.Struct("<qqdd")  # seq, step, t_issue, t_done: what differs between records alike
STATE_ISSUED, STATE_DONE, STATE_FAILED = 1, 2, 3
STATE_NAMES = {STATE_ISSUED: "issued", STATE_DONE: "completed", STATE_FAILED: "failed"}
# Not finished: issued (a Flight Recorder's "scheduled": enqueued, not yet begun on the device)
# or started (a Flight Recorder's "started": the device began it).
OPEN_STATES = ("issued", "started")
RUNNING, CLOSED, STOPPING = 1, 2, 3  # STOPPING: told to leave (SIGTERM), on its way out
T_DONE_OFFSET = struct.calcsize("<qqd")
STATE_OFFSET = struct.calcsize("<qqdd16s24s")
WRITTEN_OFFSET = struct.calcsize("<8siiii")
PROGRESS_OFFSET = struct.calcsize("<8siiiiqq")
STEP_OFFSET = struct.calcsize("<8siiiiq")
STEP_S_OFFSET = struct.calcsize("<8siiiiqqdd")
STATE_HDR_OFFSET = struct.calcsize("<8siiiiqqddd")
DEVICE_STEP_OFFSET = struct.calcsize("<8siiiiqqdddii")
CLOCK_OFFSET = struct.calcsize("<8siiiiqqdddiiq")
ERROR_OFFSET = struct.calcsize("<8siiiiqqdddiiqi")
CLOCK_HOST, CLOCK_DEVICE = 0, 1
CLOCK_NAMES = {CLOCK_HOST: "host", CLOCK_DEVICE: "device events"}
# point-to-point ops: numbered apart from the group's collectives, matched pairwise
P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})
ASYNC_P2P_OPS = frozenset({"isend", "irecv"})  # in flight is normal for them


def write_header(buffer: Any, rank: int, world_size: int, pid: int, capacity: int, attempt: int) -> None:
    """A new log's header: running, no record written, no step yet, on the host's clock."""
    now = time.time()
    fields = (
        MAGIC,
        rank,
        world_size,
        pid,
        capacity,
        0,
        -1,
        now,
        now,
        0.0,
        RUNNING,
        attempt,
        -1,
        CLOCK_HOST,
        b"",
    )
    HEADER.pack_into(buffer, 0, *fields)


def text_of(raw: bytes) -> str:
    """A fixed-size NUL-padded field as text."""
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def fit(text: str, size: int) -> bytes:
    """UTF-8, cut to the field (a cut never splits a character)."""
    raw = text.encode("utf-8")
    return raw if len(raw) <= size else raw[:size].decode("utf-8", "ignore").encode("utf-8")


def flight_path(folder: Path, rank: int, pid: int) -> Path:
    """Where a rank's flight log lives: one file per process (a restart writes a new one)."""
    return Path(folder) / f"rank{rank}-{pid}.flight"


def groups_path(flight: Path) -> Path:
    """Where a rank writes the ranks of each process group it used."""
    return Path(flight).with_suffix(".groups.json")


@dataclass
class FlightRecord:
    """One collective as a rank recorded it."""

    seq: int
    step: int
    t_issue: float
    t_done: float
    group: str
    op: str
    state: str
    dtype: str
    shapes: str
    splits: str
    site: str
    peer: int
    group_size: int

    @property
    def p2p(self) -> bool:
        """A send or receive (numbered apart from the group's collectives)."""
        return self.op in P2P_OPS


@dataclass
class FlightTail:
    """A rank's flight log as read from its file (alive or dead)."""

    path: Path
    rank: int
    world_size: int
    pid: int
    step: int
    progress_t: float
    started_t: float
    step_s: float
    closed: bool
    last_error: str
    attempt: int
    device_step: int = -1  # the last step the device finished (the host's step on the CPU)
    clock: str = "host"  # what said "completed": the host, or device events
    stopping: bool = False  # told to stop (its agent or the user): leaving on purpose, not hung
    records: list[FlightRecord] = field(default_factory=list)
    groups: dict[str, list[int]] = field(default_factory=dict)

    @property
    def left(self) -> bool:
        """Ended cleanly (closed) or on its way out on purpose (stopping): never a hang or a
        death when it goes quiet or goes away."""
        return self.closed or self.stopping

    @property
    def current_step(self) -> int:
        """The step this rank is in as the clock that completes its work sees it: on a device,
        the one after the last step the device finished (the host may be far ahead)."""
        return self.device_step + 1 if self.clock == CLOCK_NAMES[CLOCK_DEVICE] else self.step

    def open_records(self) -> list[FlightRecord]:
        """Collectives issued and not completed: where this rank may be waiting."""
        return [r for r in self.records if r.state in OPEN_STATES]

    def last_seq(self, group: str) -> int:
        """The last sequence number this rank issued on `group` (-1: none)."""
        return max((r.seq for r in self.records if r.group == group and not r.p2p), default=-1)

    def record(self, group: str, seq: int) -> FlightRecord | None:
        """This rank's record of collective #seq of `group`, if still in the ring."""
        return next((r for r in self.records if r.group == group and r.seq == seq and not r.p2p), None)


class FlightLogError(ValueError):
    """A file that is not a meshscope flight log (or is cut short)."""


def _header(raw: bytes, path: Path) -> tuple:
    if len(raw) < HEADER_SIZE or raw[:8] != MAGIC:
        raise FlightLogError(f"{path}: not a meshscope flight log")
    return HEADER.unpack_from(raw, 0)


def _records(raw: bytes, capacity: int, written: int, last: int | None) -> list[FlightRecord]:
    """The ring's records, oldest first (`last`: only the newest N)."""
    count = min(written, capacity, capacity if last is None else last)
    out = []
    for n in range(written - count, written):
        seq, step, t_issue, t_done, group, op, state, dtype, shapes, splits, site, peer, size = (
            RECORD.unpack_from(raw, HEADER_SIZE + (n % capacity) * RECORD.size)
        )
        texts = [text_of(b) for b in (group, op)]
        out.append(
            FlightRecord(
                seq,
                step,
                t_issue,
                t_done,
                *texts,
                STATE_NAMES.get(state, "?"),
                *(text_of(b) for b in (dtype, shapes, splits, site)),
                peer,
                size,
            )  # fmt: skip
        )
    return out


def read_flight(path: Path, last: int | None = None) -> FlightTail:
    """A flight log file, oldest record first (`last`: only the newest N; 0: the header)."""
    path = Path(path)
    if last == 0:
        with open(path, "rb") as f:
            raw = f.read(HEADER_SIZE)
    else:
        raw = path.read_bytes()
    (_, rank, world, pid, capacity, written, step, progress_t, started_t, step_s, state, attempt,
     device_step, clock, error) = _header(raw, path)  # fmt: skip
    tail = FlightTail(
        path,
        rank,
        world,
        pid,
        step,
        progress_t,
        started_t,
        step_s,
        state == CLOSED,
        text_of(error),
        attempt,
        device_step,
        CLOCK_NAMES.get(clock, "host"),
        state == STOPPING,
    )
    if last == 0:
        return tail
    if capacity <= 0 or len(raw) < HEADER_SIZE + capacity * RECORD.size or written < 0:
        raise FlightLogError(f"{path}: flight log cut short or damaged")
    tail.records = _records(raw, capacity, written, last)
    try:
        tail.groups = json.loads(groups_path(path).read_text())
    except (OSError, ValueError):
        tail.groups = {}
    return tail


def latest_logs(folder: Path) -> dict[int, FlightTail]:
    """The headers of the newest attempt's flight logs in `folder`, by rank (every restart
    writes new files; the old ones stay for post-mortems)."""
    heads = []
    for path in Path(folder).glob("rank*.flight"):
        try:
            heads.append(read_flight(path, last=0))
        except (OSError, FlightLogError):
            continue
    if not heads:
        return {}
    newest = max((h.attempt, h.started_t) for h in heads)[0]
    out: dict[int, FlightTail] = {}
    for h in sorted(heads, key=lambda h: h.started_t):
        if h.attempt == newest:
            out[h.rank] = h  # a rank started twice in one attempt: the later one
    return dict(sorted(out.items()))
