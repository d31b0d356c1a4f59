"""The run store: one SQLite file per run (WAL), written by every rank while readers read.

Writers queue records and a background thread commits them in batches, so the training loop
never waits on the disk. Each batch is one transaction: a killed process loses at most the
batch in flight, never the file.
"""

from __future__ import annotations

import json
import operator
import sqlite3
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshscope.collector.schema import STEP_COLUMNS, Event, StepRecord

if TYPE_CHECKING:  # the loaders return DataFrames; writing a store (the Monitor) needs no pandas
    import pandas as pd

STORE_NAME = "store.sqlite"

_STEP_TYPES = {
    "run_id": "TEXT",
    "rank": "INTEGER",
    "world_size": "INTEGER",
    "step": "INTEGER",
    "nonfinite": "TEXT",
}
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS steps (
  {", ".join(f"{c} {_STEP_TYPES.get(c, 'REAL')}" for c in STEP_COLUMNS)},
  PRIMARY KEY (rank, step)
);
CREATE TABLE IF NOT EXISTS expert_load (
  step INTEGER NOT NULL, layer INTEGER NOT NULL, expert INTEGER NOT NULL, tokens REAL NOT NULL,
  PRIMARY KEY (step, layer, expert)
);
CREATE TABLE IF NOT EXISTS events (
  id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, run_id TEXT NOT NULL,
  kind TEXT NOT NULL, severity TEXT NOT NULL, rank INTEGER, step INTEGER, detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_kind ON events (kind, step);
CREATE TABLE IF NOT EXISTS tensor_stats (
  step INTEGER NOT NULL, rank INTEGER NOT NULL, module TEXT NOT NULL, "where" TEXT NOT NULL,
  absmax REAL, norm REAL, mean REAL, std REAL, nonfinite INTEGER,
  PRIMARY KEY (step, rank, module, "where")
);
CREATE TABLE IF NOT EXISTS controls (
  id INTEGER PRIMARY KEY AUTOINCREMENT, created REAL NOT NULL, kind TEXT NOT NULL,
  layer INTEGER NOT NULL, payload TEXT NOT NULL, suggestion INTEGER, status TEXT NOT NULL,
  step INTEGER, old TEXT, new TEXT, note TEXT, outcome TEXT
);
CREATE TABLE IF NOT EXISTS grad_stats (
  step INTEGER NOT NULL, module TEXT NOT NULL, grad_norm REAL, weight_norm REAL,
  update_ratio REAL, PRIMARY KEY (step, module)
);
"""
TENSOR_STAT_COLUMNS = ("step", "rank", "module", "where", "absmax", "norm", "mean", "std", "nonfinite")
GRAD_STAT_COLUMNS = ("step", "module", "grad_norm", "weight_norm", "update_ratio")


_STEP_ROW = operator.attrgetter(*STEP_COLUMNS)  # a StepRecord as a row, in one C call


def store_path(run_dir: str | Path) -> Path:
    """The run store's file in a run directory."""
    return Path(run_dir) / STORE_NAME


def _connect(path: Path, *, readonly: bool = False) -> sqlite3.Connection:
    if readonly:
        if not path.exists():
            raise FileNotFoundError(f"no run store at {path}")
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    else:
        conn = sqlite3.connect(path, timeout=30, check_same_thread=False)
    conn.execute("PRAGMA busy_timeout=30000")
    return conn


def open_store(run_dir: str | Path) -> sqlite3.Connection:
    """Create the schema if needed (safe when all ranks do it at once) and return a connection."""
    path = store_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = _connect(path)
    for attempt in range(50):
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(_SCHEMA)
            _migrate(conn)
            return conn
        except sqlite3.OperationalError as err:  # another rank holds the lock while creating
            if "locked" not in str(err) or attempt == 49:
                raise
            time.sleep(0.05)
    return conn


def _migrate(conn: sqlite3.Connection) -> None:
    """Columns added since a store was created (a run resumed by a newer meshscope)."""
    have = {row[1] for row in conn.execute("PRAGMA table_info(steps)")}
    for column in STEP_COLUMNS:
        if column not in have:
            kind = _STEP_TYPES.get(column, "REAL")
            default = "''" if kind == "TEXT" else "NULL"
            conn.execute(f"ALTER TABLE steps ADD COLUMN {column} {kind} DEFAULT {default}")


class RunStore:
    """Batched, thread-backed writer for one process. `close()` flushes everything queued."""

    def __init__(self, run_dir: str | Path, *, flush_interval_s: float = 0.5) -> None:
        self.run_dir = Path(run_dir)
        self._conn = open_store(self.run_dir)
        # A plain list, swapped by the writer: adding a record never wakes a thread (a wake-up
        # per step costs a context switch and a GIL hand-off on a busy host).
        self._items: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()  # flush and close only
        self._stopping = False
        self._flush_interval_s = flush_interval_s
        self._thread = threading.Thread(target=self._writer, name="meshscope-store", daemon=True)
        self._thread.start()

    def _put(self, item: tuple[str, Any]) -> None:
        with self._lock:
            self._items.append(item)

    def add_step(self, rec: StepRecord) -> None:
        """Queue a StepRecord for the writer thread."""
        self._put(("step", rec))

    def add_event(self, event: Event) -> None:
        """Queue an Event for the writer thread."""
        self._put(("event", event))

    def add_expert_load(self, step: int, tokens: list[list[float]]) -> None:
        """Queue one window's tokens per (layer, expert)."""
        self._put(("experts", (step, tokens)))

    def add_tensor_stats(self, rows: list[dict[str, Any]]) -> None:
        """Per-module tensor statistics of one step (the tracer's `stats` mode)."""
        self._put(("stats", [tuple(r[c] for c in TENSOR_STAT_COLUMNS) for r in rows]))

    def add_grad_stats(self, rows: list[dict[str, Any]]) -> None:
        """Per-layer gradient and update norms of one step (the gradient inspector)."""
        self._put(("grads", [tuple(r[c] for c in GRAD_STAT_COLUMNS) for r in rows]))

    def flush(self, timeout: float = 30.0) -> None:
        """Block until everything queued so far is committed."""
        done = threading.Event()
        self._put(("barrier", done))
        self._wake.set()
        done.wait(timeout)

    def close(self) -> None:
        """Write what is queued and close the connection."""
        if self._thread.is_alive():
            self._stopping = True
            self._wake.set()
            self._thread.join(timeout=60)
        self._conn.close()

    def _writer(self) -> None:
        while True:
            self._wake.wait(self._flush_interval_s)
            self._wake.clear()
            stopping = self._stopping  # read before taking the batch: nothing is left behind
            with self._lock:
                items, self._items = self._items, []
            if items:
                self._commit(items)
            if stopping:
                return

    def _commit(self, items: list[tuple[str, Any]]) -> None:
        """Write one batch in one transaction, then release the flushes waiting on it."""
        rows: dict[str, list[tuple]] = {kind: [] for kind in _INSERT}
        barriers = []
        for kind, payload in items:
            if kind == "barrier":
                barriers.append(payload)
            else:
                rows[kind].extend(_ROWS[kind](payload))
        with self._conn:  # one transaction per batch
            for kind, batch in rows.items():
                if batch:
                    self._conn.executemany(_INSERT[kind], batch)
        for done in barriers:
            done.set()


def _insert(table: str, columns: tuple[str, ...], verb: str = "INSERT OR REPLACE") -> str:
    names = ",".join(f'"{c}"' for c in columns)
    return f"{verb} INTO {table} ({names}) VALUES ({','.join('?' * len(columns))})"


def _event_row(e: Event) -> list[tuple]:
    return [(e.time, e.run_id, e.kind, e.severity, e.rank, e.step, json.dumps(e.detail, default=str))]


def _expert_rows(payload: tuple[int, list[list[float]]]) -> list[tuple]:
    step, table = payload
    return [
        (step, layer, expert, float(tok)) for layer, row in enumerate(table) for expert, tok in enumerate(row)
    ]


# Per queued kind: how its payload becomes rows, and the statement that writes them.
_ROWS: dict[str, Any] = {
    "step": lambda rec: [_STEP_ROW(rec)],
    "event": _event_row,
    "experts": _expert_rows,
    "stats": list,
    "grads": list,
}
_INSERT = {
    "step": _insert("steps", STEP_COLUMNS),
    "event": _insert("events", ("time", "run_id", "kind", "severity", "rank", "step", "detail"), "INSERT"),
    "experts": _insert("expert_load", ("step", "layer", "expert", "tokens")),
    "stats": _insert("tensor_stats", TENSOR_STAT_COLUMNS),
    "grads": _insert("grad_stats", GRAD_STAT_COLUMNS),
}


class StoreError(ValueError):
    """A file that is not a readable meshscope run store; the message says why."""


_REQUIRED = {"steps": ("rank", "step", "step_s"), "events": ("id", "kind", "detail")}


def check_store(run_dir: str | Path) -> None:
    """FileNotFoundError when there is no store, StoreError when the file is not a readable
    meshscope run store (corrupt, truncated, foreign, empty); reads only."""
    path = store_path(run_dir)
    if not path.is_file():
        raise FileNotFoundError(f"no run store at {path}")
    try:
        conn = _connect(path, readonly=True)
        try:
            columns = {t: {row[1] for row in conn.execute(f"PRAGMA table_info({t})")} for t in _REQUIRED}
        finally:
            conn.close()
    except sqlite3.DatabaseError as err:
        raise StoreError(f"{path}: not a readable meshscope run store ({err})") from None
    for table, needed in _REQUIRED.items():
        missing = [c for c in needed if c not in columns[table]]
        if missing:
            raise StoreError(f"{path}: not a meshscope run store (table {table} lacks {', '.join(missing)})")


def insert_events(run_dir: str | Path, events: list[Event]) -> list[int]:
    """Write events now, outside any RunStore, and return their ids (for writers that link to
    what they wrote: the feedback loop's suggestions)."""
    conn = open_store(run_dir)
    try:
        with conn:
            return [
                int(
                    conn.execute(
                        "INSERT INTO events (time, run_id, kind, severity, rank, step, detail) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (
                            e.time,
                            e.run_id,
                            e.kind,
                            e.severity,
                            e.rank,
                            e.step,
                            json.dumps(e.detail, default=str),
                        ),
                    ).lastrowid
                )
                for e in events
            ]
    finally:
        conn.close()


def _read(run_dir: str | Path, sql: str, params: tuple = ()) -> pd.DataFrame:
    import pandas as pd

    path = store_path(run_dir)
    conn = _connect(path, readonly=True)
    try:
        return pd.read_sql_query(sql, conn, params=params)
    except (sqlite3.OperationalError, pd.errors.DatabaseError) as err:
        # A file with no tables yet is a store a rank is creating right now: not there yet.
        if (
            "no such table" in str(err)
            and not conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
        ):
            raise FileNotFoundError(f"no run store at {path} yet (being created)") from None
        raise
    finally:
        conn.close()


def load_steps(run_dir: str | Path, *, since_step: int = -1) -> pd.DataFrame:
    """All StepRecords of a run, ordered by step then rank."""
    return _read(run_dir, "SELECT * FROM steps WHERE step > ? ORDER BY step, rank", (since_step,))


def load_expert_load(run_dir: str | Path, *, since_step: int = -1) -> pd.DataFrame:
    """Expert tokens per (step, layer, expert), summed over ranks over the window ending at step."""
    return _read(
        run_dir, "SELECT * FROM expert_load WHERE step > ? ORDER BY step, layer, expert", (since_step,)
    )


def load_events(run_dir: str | Path, kind: str | None = None) -> pd.DataFrame:
    """Events, with `detail` decoded from JSON."""
    if kind is None:
        df = _read(run_dir, "SELECT * FROM events ORDER BY id")
    else:
        df = _read(run_dir, "SELECT * FROM events WHERE kind = ? ORDER BY id", (kind,))
    df["detail"] = [json.loads(d) for d in df["detail"]]
    return df


def load_tensor_stats(run_dir: str | Path, *, module: str | None = None) -> pd.DataFrame:
    """The tracer's per-module statistics, by step, rank and module."""
    if module is None:
        return _read(run_dir, "SELECT * FROM tensor_stats ORDER BY step, rank, module")
    return _read(run_dir, "SELECT * FROM tensor_stats WHERE module = ? ORDER BY step, rank", (module,))


def load_grad_stats(run_dir: str | Path, *, since_step: int = -1) -> pd.DataFrame:
    """The gradient inspector's per-layer norms and update ratios, by step."""
    import pandas as pd

    try:
        return _read(run_dir, "SELECT * FROM grad_stats WHERE step > ? ORDER BY step, module", (since_step,))
    except (sqlite3.OperationalError, pd.errors.DatabaseError) as err:
        if "no such table" in str(err):  # a store written before the inspector existed
            return pd.DataFrame(columns=list(GRAD_STAT_COLUMNS))
        raise


def latest_step(run_dir: str | Path, rank: int | None = 0) -> int:
    """Highest step recorded by `rank` (None: the lowest rank this store holds, which on a
    node of a multi-node job need not be 0), -1 when none (cheap enough to poll)."""
    path = store_path(run_dir)
    if not path.exists():
        return -1
    conn = _connect(path, readonly=True)
    try:
        if rank is None:
            row = conn.execute(
                "SELECT MAX(step) FROM steps WHERE rank = (SELECT MIN(rank) FROM steps)"
            ).fetchone()
        else:
            row = conn.execute("SELECT MAX(step) FROM steps WHERE rank = ?", (rank,)).fetchone()
    except sqlite3.OperationalError:  # schema not created yet
        return -1
    finally:
        conn.close()
    return -1 if row is None or row[0] is None else int(row[0])
