"""The run store: what every rank writes while readers read, behind one API whatever holds it.

Every rank writes its node's SQLite file (WAL) in the run directory. Writers queue records and
a background thread commits them in batches (the store's own, or the Monitor's service thread),
so the training loop never waits on the disk; each
batch is one transaction: a killed process loses at most the batch in flight, never the file.
A job on several nodes also has one job store on PostgreSQL, named by the run directory's
`store.json` (collector/storedb.py) and fed by each node's relay (collector/relay.py); readers
of such a directory read the job store, so every node sees the whole job.
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
from meshscope.collector.service import Service
from meshscope.collector.storedb import (
    STORE_NAME,
    StoreTarget,
    StoreUnavailable,
    insert_sql,
    locate,
    pg_frame,
    pg_session,
    pg_sql,
    pg_tables,
    retire_sql,
    sqlite_connect,
    sqlite_open,
)

if TYPE_CHECKING:  # the loaders return DataFrames; writing a store (the Monitor) needs no pandas
    import pandas as pd

__all__ = ["STORE_NAME", "StoreUnavailable"]  # re-exported: readers name them from here
TENSOR_STAT_COLUMNS = ("step", "rank", "module", "where", "absmax", "norm", "mean", "std", "nonfinite")
GRAD_STAT_COLUMNS = ("step", "module", "grad_norm", "weight_norm", "update_ratio")
EVENT_COLUMNS = ("time", "run_id", "kind", "severity", "rank", "step", "detail")


NUMERIC_STEP_COLUMNS = frozenset(STEP_COLUMNS) - {"run_id", "nonfinite"}
_STEP_ROW = operator.attrgetter(*STEP_COLUMNS)  # a StepRecord as a row, in one C call
_STEP_KEY = operator.itemgetter(*(STEP_COLUMNS.index(c) for c in ("rank", "step", "attempt")))
_ATTEMPT = STEP_COLUMNS.index("attempt")


def store_path(run_dir: str | Path) -> Path:
    """The SQLite store's file in a run directory (where a one-node run keeps its store)."""
    return Path(run_dir) / STORE_NAME


def describe_store(run_dir: str | Path) -> str:
    """Where a run's store is, for messages: its file, or its job store's server and schema."""
    return locate(run_dir).describe(run_dir)


def has_store(run_dir: str | Path) -> bool:
    """A run directory with a store to read (its file, or a locator naming a job store)."""
    return locate(run_dir).is_postgres or store_path(run_dir).is_file()


def store_version(run_dir: str | Path) -> float:
    """Changes whenever the store does (the WAL included): a cache key for readers that poll."""
    if locate(run_dir).is_postgres:
        try:
            rows = fetch(
                run_dir,
                "SELECT (SELECT max(time) FROM steps), (SELECT max(id) FROM events), "
                "(SELECT count(*) FROM controls)",
            )
        except StoreUnavailable:
            return 0.0
        return float(sum(v or 0 for v in rows[0])) if rows else 0.0
    path = store_path(run_dir)
    paths = [path, path.with_name(path.name + "-wal")]
    return max((p.stat().st_mtime for p in paths if p.exists()), default=0.0)


def open_store(run_dir: str | Path) -> sqlite3.Connection:
    """The SQLite store of a run directory, schema created (safe when all ranks do it at once)."""
    return sqlite_open(store_path(run_dir))


class RunStore:
    """Batched, thread-backed writer for one process into its node's SQLite file (a job store
    gets the rows from the node's relay). `close()` flushes everything queued.

    `writer=False`: no thread of its own; its owner commits from a thread it already runs
    (`write_queued`: the Monitor's service thread), one thread fewer to wake on
    a busy host, and `flush()` commits on the caller's thread."""

    def __init__(self, run_dir: str | Path, *, flush_interval_s: float = 0.5, writer: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.flush_interval_s = flush_interval_s
        self._conn = open_store(self.run_dir)
        # A plain list, swapped by the writer: adding a record never wakes a thread (a wake-up
        # per step costs a context switch and a GIL hand-off on a busy host).
        self._items: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        self._commit_lock = threading.Lock()  # batches commit one at a time, in queue order
        self.committed_at = time.monotonic()  # the latest commit (an owner's cadence: `service.due`)
        self._writer = StoreWriter(self, flush_interval_s).start() if writer else None

    @property
    def _thread(self) -> threading.Thread | None:
        """The writer's thread (what a benchmark meters); None where the owner commits."""
        return self._writer._thread if self._writer is not None else None

    @property
    def owner_commits(self) -> bool:
        """Whether its owner commits it (`writer=False`), not a thread of its own."""
        return self._writer is None

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

    def add_expert_work(self, step: int, rank: int, tokens: list[float]) -> None:
        """Queue one window's tokens this rank's experts processed, per layer."""
        self._put(("work", (step, rank, tokens)))

    def add_tensor_stats(self, rows: list[dict[str, Any]]) -> None:
        """Per-module tensor statistics of one step (the tracer's `stats` mode)."""
        self._put(("stats", [tuple(r[c] for c in TENSOR_STAT_COLUMNS) for r in rows]))

    def add_grad_stats(self, rows: list[dict[str, Any]]) -> None:
        """Per-layer gradient and update norms of one step (the gradient inspector)."""
        self._put(("grads", [tuple(r[c] for c in GRAD_STAT_COLUMNS) for r in rows]))

    def flush(self, timeout: float = 30.0) -> bool:
        """Block until everything queued so far is committed (False: `timeout` came first)."""
        if self._writer is None:  # its owner commits: here, now
            self.write_queued()
            return True
        done = threading.Event()
        self._put(("barrier", done))
        self._writer.wake()
        return done.wait(timeout)

    def close(self) -> None:
        """Write what is queued and close the connection."""
        if self._writer is not None and self._writer.running:
            self._writer.stop()  # its last round writes what is queued
        else:
            self.write_queued()  # no writer (a forked child's copy): write it here
        self._conn.close()

    def write_queued(self) -> None:
        """Commit what is queued now, in one transaction (the writer's round)."""
        with self._commit_lock:
            self.committed_at = time.monotonic()
            with self._lock:
                items, self._items = self._items, []
            if items:
                self._commit(items)

    def _commit(self, items: list[tuple[str, Any]]) -> None:
        """Write one batch in one transaction, then release the flushes waiting on it."""
        rows: dict[str, list[tuple]] = {kind: [] for kind in _ROWS}
        barriers = []
        for kind, payload in items:
            if kind == "barrier":
                barriers.append(payload)
            else:
                rows[kind].extend(_ROWS[kind](payload))
        with self._conn:  # one transaction per batch
            # a restart's redo keeps the earlier attempt's row, in steps_retried (attempt 0
            # retires nothing: a lookup a row spared)
            if any(row[_ATTEMPT] for row in rows["step"]):
                self._conn.executemany(_RETIRE, map(_STEP_KEY, rows["step"]))
            for kind, batch in rows.items():
                if batch:
                    self._conn.executemany(_INSERT[kind], batch)
        for done in barriers:
            done.set()


class StoreWriter(Service):
    """The store's writer thread: a batch every `flush_interval_s`, sooner on a flush, and what
    is left when it stops (adding a record never wakes it: a wake-up per step costs a context
    switch and a GIL hand-off on a busy host)."""

    def __init__(self, store: RunStore, interval_s: float) -> None:
        super().__init__("meshscope-store", interval_s, join_s=60.0)
        self.store = store

    def round(self) -> None:
        """Commit what is queued."""
        self.store.write_queued()

    def after_rounds(self) -> None:
        """Commit what came after the last round."""
        self.store.write_queued()


def _event_row(e: Event) -> list[tuple]:
    return [(e.time, e.run_id, e.kind, e.severity, e.rank, e.step, json.dumps(e.detail, default=str))]


def _expert_rows(payload: tuple[int, list[list[float]]]) -> list[tuple]:
    step, table = payload
    return [
        (step, layer, expert, float(tok)) for layer, row in enumerate(table) for expert, tok in enumerate(row)
    ]


def _work_rows(payload: tuple[int, int, list[float]]) -> list[tuple]:
    step, rank, tokens = payload
    return [(step, rank, layer, float(t)) for layer, t in enumerate(tokens)]


# Per queued kind: how its payload becomes rows, and the statement that writes them.
_ROWS: dict[str, Any] = {
    "step": lambda rec: [_STEP_ROW(rec)],
    "event": _event_row,
    "experts": _expert_rows,
    "work": _work_rows,
    "stats": list,
    "grads": list,
}
_TABLE_OF = {
    "step": ("steps", STEP_COLUMNS, True),
    "event": ("events", EVENT_COLUMNS, False),
    "experts": ("expert_load", ("step", "layer", "expert", "tokens"), True),
    "work": ("expert_work", ("step", "rank", "layer", "tokens"), True),
    "stats": ("tensor_stats", TENSOR_STAT_COLUMNS, True),
    "grads": ("grad_stats", GRAD_STAT_COLUMNS, True),
}


_INSERT = {kind: insert_sql("sqlite", t, cols, replace=keyed) for kind, (t, cols, keyed) in _TABLE_OF.items()}
_RETIRE = retire_sql("sqlite")
# What a node's relay ships to the job store: table -> (columns, replaced on its key).
RELAY_TABLES = {table: (columns, keyed) for table, columns, keyed in _TABLE_OF.values()}
RELAY_TABLES["steps_retried"] = (STEP_COLUMNS, True)


class StoreError(ValueError):
    """A file that is not a readable meshscope run store; the message says why."""


_REQUIRED = {"steps": ("rank", "step", "step_s"), "events": ("id", "kind", "detail")}


def check_store(run_dir: str | Path) -> None:
    """FileNotFoundError when there is no store, StoreError when it is not a readable meshscope
    run store (corrupt, truncated, foreign, empty, a job store that does not answer); reads only."""
    target = locate(run_dir)
    where = target.describe(run_dir)
    try:
        columns = _pg_columns(target) if target.is_postgres else _sqlite_columns(store_path(run_dir))
    except (sqlite3.DatabaseError, StoreUnavailable) as err:
        raise StoreError(f"{where}: not a readable meshscope run store ({err})") from None
    for table, needed in _REQUIRED.items():
        missing = [c for c in needed if c not in columns.get(table, ())]
        if missing:
            raise StoreError(f"{where}: not a meshscope run store (table {table} lacks {', '.join(missing)})")


def _sqlite_columns(path: Path) -> dict[str, set[str]]:
    if not path.is_file():
        raise FileNotFoundError(f"no run store at {path}")
    conn = sqlite_connect(path, readonly=True)
    try:
        return {t: {row[1] for row in conn.execute(f"PRAGMA table_info({t})")} for t in _REQUIRED}
    finally:
        conn.close()


def _pg_columns(target: StoreTarget) -> dict[str, set[str]]:
    with pg_session(target) as conn:
        tables = pg_tables(conn)
    if not tables:
        raise FileNotFoundError(f"no run store in {target.describe('')} yet")
    return tables


def execute(run_dir: str | Path, sql: str, params: tuple = ()) -> list[tuple]:
    """Run one writing statement now, outside any RunStore (`?` parameters, any database); the
    rows it returns (`RETURNING id` gives the new ids)."""
    target = locate(run_dir)
    if target.is_postgres:
        with pg_session(target, create=True) as conn:
            cur = conn.execute(pg_sql(sql), params)
            return cur.fetchall() if cur.description else []
    conn = open_store(run_dir)
    try:
        with conn:
            return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def fetch(run_dir: str | Path, sql: str, params: tuple = ()) -> list[tuple]:
    """Rows of one query (`?` parameters, any database); [] when the store or table is not there yet."""
    target = locate(run_dir)
    if target.is_postgres:
        import psycopg

        with pg_session(target) as conn:
            try:
                return conn.execute(pg_sql(sql), params).fetchall()
            except psycopg.errors.UndefinedTable:
                return []
    path = store_path(run_dir)
    if not path.exists():
        return []
    conn = sqlite_connect(path, readonly=True)
    try:
        return conn.execute(sql, params).fetchall()
    except sqlite3.OperationalError:  # schema not created yet
        return []
    finally:
        conn.close()


def insert_events(run_dir: str | Path, events: list[Event]) -> list[int]:
    """Write events now, outside any RunStore, and return their ids (for writers that link to
    what they wrote: the feedback loop's suggestions)."""
    sql = insert_sql("sqlite", "events", EVENT_COLUMNS, replace=False) + " RETURNING id"
    return [int(execute(run_dir, sql, row)[0][0]) for e in events for row in _event_row(e)]


def read_frame(run_dir: str | Path, sql: str, params: tuple = ()) -> pd.DataFrame:
    """A query's rows as a DataFrame, from whichever database holds the run."""
    import pandas as pd

    target = locate(run_dir)
    if target.is_postgres:
        import psycopg

        with pg_session(target) as conn:
            try:
                return pg_frame(conn, sql, params)
            except psycopg.errors.UndefinedTable:
                raise FileNotFoundError(f"no run store in {target.describe(run_dir)} yet") from None
    path = store_path(run_dir)
    conn = sqlite_connect(path, readonly=True)
    try:
        try:
            return pd.read_sql_query(sql, conn, params=params)
        except (sqlite3.OperationalError, pd.errors.DatabaseError) as err:
            if "no such table" not in str(err):
                raise
            # A file with no tables yet is a store a rank is creating right now: not there yet.
            if not conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
                raise FileNotFoundError(f"no run store at {path} yet (being created)") from None
        # Its tables land in one transaction: they came between the query and the look (asked
        # again), or this file is another kind of database (the same error again)
        return pd.read_sql_query(sql, conn, params=params)
    finally:
        conn.close()


def load_steps(run_dir: str | Path, *, since_step: int = -1) -> pd.DataFrame:
    """All StepRecords of a run (the attempt that completed each step), ordered by step then rank."""
    sql = "SELECT * FROM steps WHERE step > ? ORDER BY step, rank"
    return _numeric(read_frame(run_dir, sql, (since_step,)))


def _numeric(df: pd.DataFrame) -> pd.DataFrame:
    """A number never measured (NULL in every row, e.g. an unlogged loss) reads as NaN, not None."""
    for column in NUMERIC_STEP_COLUMNS.intersection(df.columns):
        if df[column].dtype == object:
            df[column] = df[column].astype(float)
    return df


def load_retried_steps(run_dir: str | Path) -> pd.DataFrame:
    """The StepRecords a later attempt redid (a restart resumed before them), ordered by
    attempt, step, rank; empty for a run that never redid a step or a store before version 3."""
    import pandas as pd

    try:
        df = read_frame(run_dir, "SELECT * FROM steps_retried ORDER BY attempt, step, rank")
    except (FileNotFoundError, sqlite3.DatabaseError, pd.errors.DatabaseError):  # kept none
        return pd.DataFrame(columns=list(STEP_COLUMNS))
    return _numeric(df)


def load_expert_load(run_dir: str | Path, *, since_step: int = -1) -> pd.DataFrame:
    """Expert tokens per (step, layer, expert), summed over ranks over the window ending at step."""
    return read_frame(
        run_dir, "SELECT * FROM expert_load WHERE step > ? ORDER BY step, layer, expert", (since_step,)
    )


def load_events(run_dir: str | Path, kind: str | None = None) -> pd.DataFrame:
    """Events, with `detail` decoded from JSON."""
    if kind is None:
        df = read_frame(run_dir, "SELECT * FROM events ORDER BY id")
    else:
        df = read_frame(run_dir, "SELECT * FROM events WHERE kind = ? ORDER BY id", (kind,))
    df["detail"] = [json.loads(d) for d in df["detail"]]
    return df


def load_expert_work(run_dir: str | Path) -> pd.DataFrame:
    """Tokens each rank's experts processed per (step, rank, layer), over the window ending at
    step (expert parallelism); empty for a run without it or a store from before it."""
    import pandas as pd

    try:
        return read_frame(run_dir, "SELECT * FROM expert_work ORDER BY step, rank, layer")
    except (FileNotFoundError, sqlite3.DatabaseError, pd.errors.DatabaseError):
        return pd.DataFrame(columns=["step", "rank", "layer", "tokens"])


def load_tensor_stats(run_dir: str | Path, *, module: str | None = None) -> pd.DataFrame:
    """The tracer's per-module statistics, by step, rank and module."""
    if module is None:
        return read_frame(run_dir, "SELECT * FROM tensor_stats ORDER BY step, rank, module")
    return read_frame(run_dir, "SELECT * FROM tensor_stats WHERE module = ? ORDER BY step, rank", (module,))


def load_grad_stats(run_dir: str | Path, *, since_step: int = -1) -> pd.DataFrame:
    """The gradient inspector's per-layer norms and update ratios, by step."""
    import pandas as pd

    try:
        sql = "SELECT * FROM grad_stats WHERE step > ? ORDER BY step, module"
        return read_frame(run_dir, sql, (since_step,))
    except (sqlite3.OperationalError, pd.errors.DatabaseError) as err:
        if "no such table" in str(err):  # a store written before the inspector existed
            return pd.DataFrame(columns=list(GRAD_STAT_COLUMNS))
        raise


def latest_step(run_dir: str | Path, rank: int | None = 0) -> int:
    """Highest step recorded by `rank` (None: the lowest rank the store holds), -1 when none
    (cheap enough to poll)."""
    if rank is None:
        rows = fetch(run_dir, "SELECT MAX(step) FROM steps WHERE rank = (SELECT MIN(rank) FROM steps)")
    else:
        rows = fetch(run_dir, "SELECT MAX(step) FROM steps WHERE rank = ?", (rank,))
    return -1 if not rows or rows[0][0] is None else int(rows[0][0])
