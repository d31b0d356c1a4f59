"""The run store: what every rank writes while readers read, behind one API whatever holds it.

One node: one SQLite file per run (WAL) in the run directory. Several nodes: one job store on
PostgreSQL that the run directory's `store.json` names (collector/storedb.py). Writers queue
records and a background thread commits them in batches, so the training loop never waits on
the disk or the network. Each batch is one transaction: a killed process loses at most the
batch in flight, never the store; a job store that is down is buffered for, and nothing
acknowledged is lost.
"""

from __future__ import annotations

import json
import logging
import operator
import sqlite3
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshscope.collector.schema import STEP_COLUMNS, Event, StepRecord
from meshscope.collector.storedb import (
    STORE_NAME,
    StoreTarget,
    StoreUnavailable,
    insert_sql,
    locate,
    pg_connect,
    pg_frame,
    pg_sql,
    pg_tables,
    sqlite_connect,
    sqlite_open,
)

if TYPE_CHECKING:  # the loaders return DataFrames; writing a store (the Monitor) needs no pandas
    import pandas as pd

log = logging.getLogger("meshscope.store")

__all__ = ["STORE_NAME", "StoreUnavailable"]  # re-exported: readers name them from here
TENSOR_STAT_COLUMNS = ("step", "rank", "module", "where", "absmax", "norm", "mean", "std", "nonfinite")
GRAD_STAT_COLUMNS = ("step", "module", "grad_norm", "weight_norm", "update_ratio")
EVENT_COLUMNS = ("time", "run_id", "kind", "severity", "rank", "step", "detail")
CLOSE_RETRY_S = 30.0  # how long close() keeps trying a job store that is down before it spills


_STEP_ROW = operator.attrgetter(*STEP_COLUMNS)  # a StepRecord as a row, in one C call


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


class _SqliteSink:
    """Batches into the run directory's SQLite file."""

    def __init__(self, run_dir: Path) -> None:
        self._conn = open_store(run_dir)

    def write(self, rows: dict[str, list[tuple]]) -> None:
        with self._conn:  # one transaction per batch
            for kind, batch in rows.items():
                if batch:
                    self._conn.executemany(_INSERT["sqlite"][kind], batch)

    def close(self) -> None:
        self._conn.close()


class _PgSink:
    """Batches into the job store; StoreUnavailable while its server does not answer."""

    def __init__(self, target: StoreTarget) -> None:
        self.target = target
        self._conn: Any = None

    def write(self, rows: dict[str, list[tuple]]) -> None:
        import psycopg

        try:
            if self._conn is None or self._conn.closed:
                self._conn = pg_connect(self.target, create=True)
            with self._conn.transaction(), self._conn.cursor() as cur:
                for kind, batch in rows.items():
                    if batch:  # psycopg pipelines executemany: one round trip per batch, not per row
                        cur.executemany(_INSERT["postgresql"][kind], batch)
        except (psycopg.OperationalError, psycopg.InterfaceError) as err:
            self.close()
            first_line = str(err).strip().splitlines()[0]
            raise StoreUnavailable(f"job store {self.target.url}: {first_line}") from None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class RunStore:
    """Batched, thread-backed writer for one process. `close()` flushes everything queued."""

    def __init__(self, run_dir: str | Path, *, flush_interval_s: float = 0.5) -> None:
        self.run_dir = Path(run_dir)
        self.target = locate(self.run_dir)
        self._sink: _SqliteSink | _PgSink = (
            _PgSink(self.target) if self.target.is_postgres else _SqliteSink(self.run_dir)
        )
        # A plain list, swapped by the writer: adding a record never wakes a thread (a wake-up
        # per step costs a context switch and a GIL hand-off on a busy host).
        self._items: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()  # flush and close only
        self._stopping = False
        self._down_since: float | None = None  # the job store stopped answering then
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

    def flush(self, timeout: float = 30.0) -> bool:
        """Block until everything queued so far is committed; False when `timeout` came first
        (the job store is down: the records stay queued)."""
        done = threading.Event()
        self._put(("barrier", done))
        self._wake.set()
        return done.wait(timeout)

    def close(self) -> None:
        """Write what is queued and close the connection."""
        if self._thread.is_alive():
            self._stopping = True
            self._wake.set()
            self._thread.join(timeout=CLOSE_RETRY_S + 30)
        self._sink.close()

    def _writer(self) -> None:
        deadline = None
        while True:
            self._wake.wait(self._flush_interval_s)
            self._wake.clear()
            stopping = self._stopping  # read before taking the batch: nothing is left behind
            with self._lock:
                items, self._items = self._items, []
            if items and not self._commit(items):
                with self._lock:  # keep them, in order, ahead of what came since
                    self._items = items + self._items
                if stopping:
                    deadline = deadline or time.monotonic() + CLOSE_RETRY_S
                    if time.monotonic() < deadline:
                        continue
                    self._spill()
                    return
                continue
            if stopping:
                return

    def _commit(self, items: list[tuple[str, Any]]) -> bool:
        """Write one batch in one transaction, then release the flushes waiting on it; False
        when the job store is down (the batch is kept for the next round)."""
        rows: dict[str, list[tuple]] = {kind: [] for kind in _ROWS}
        barriers = []
        for kind, payload in items:
            if kind == "barrier":
                barriers.append(payload)
            else:
                rows[kind].extend(_ROWS[kind](payload))
        try:
            self._sink.write(rows)
        except StoreUnavailable as err:
            if self._down_since is None:  # one warning per outage
                self._down_since = time.monotonic()
                log.warning("%s; buffering records until it answers", err)
            return False
        if self._down_since is not None:
            log.warning(
                "job store answers again after %.1f s; buffered records written",
                time.monotonic() - self._down_since,
            )
            self._down_since = None
        for done in barriers:
            done.set()
        return True

    def _spill(self) -> None:
        """The job store stayed down through close(): keep the records in this node's SQLite
        file rather than lose them, and say where they are."""
        with self._lock:
            items, self._items = self._items, []
        spill = _SqliteSink(self.run_dir)
        rows: dict[str, list[tuple]] = {kind: [] for kind in _ROWS}
        for kind, payload in items:
            if kind != "barrier":
                rows[kind].extend(_ROWS[kind](payload))
        spill.write(rows)
        spill.close()
        log.error(
            "job store %s still down at close: %d record(s) kept in %s",
            self.target.url,
            sum(map(len, rows.values())),
            store_path(self.run_dir),
        )


def _event_row(e: Event) -> list[tuple]:
    return [(e.time, e.run_id, e.kind, e.severity, e.rank, e.step, json.dumps(e.detail, default=str))]


def _expert_rows(payload: tuple[int, list[list[float]]]) -> list[tuple]:
    step, table = payload
    return [
        (step, layer, expert, float(tok)) for layer, row in enumerate(table) for expert, tok in enumerate(row)
    ]


# Per queued kind: how its payload becomes rows, and (per database) the statement that writes them.
_ROWS: dict[str, Any] = {
    "step": lambda rec: [_STEP_ROW(rec)],
    "event": _event_row,
    "experts": _expert_rows,
    "stats": list,
    "grads": list,
}
_TABLE_OF = {
    "step": ("steps", STEP_COLUMNS, True),
    "event": ("events", EVENT_COLUMNS, False),
    "experts": ("expert_load", ("step", "layer", "expert", "tokens"), True),
    "stats": ("tensor_stats", TENSOR_STAT_COLUMNS, True),
    "grads": ("grad_stats", GRAD_STAT_COLUMNS, True),
}


def _statement(dialect: str, kind: str) -> str:
    table, columns, replace = _TABLE_OF[kind]
    sql = insert_sql(dialect, table, columns, replace=replace)
    return sql if dialect == "sqlite" else pg_sql(sql)


_INSERT = {d: {kind: _statement(d, kind) for kind in _TABLE_OF} for d in ("sqlite", "postgresql")}


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
    with pg_connect(target) as conn:
        tables = pg_tables(conn)
    if not tables:
        raise FileNotFoundError(f"no run store in {target.describe('')} yet")
    return tables


def execute(run_dir: str | Path, sql: str, params: tuple = ()) -> list[tuple]:
    """Run one writing statement now, outside any RunStore (`?` parameters, any database); the
    rows it returns (`RETURNING id` gives the new ids)."""
    target = locate(run_dir)
    if target.is_postgres:
        with pg_connect(target, create=True) as conn:
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

        with pg_connect(target) as conn:
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

        with pg_connect(target) as conn:
            try:
                return pg_frame(conn, sql, params)
            except psycopg.errors.UndefinedTable:
                raise FileNotFoundError(f"no run store in {target.describe(run_dir)} yet") from None
    path = store_path(run_dir)
    conn = sqlite_connect(path, readonly=True)
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
    return read_frame(run_dir, "SELECT * FROM steps WHERE step > ? ORDER BY step, rank", (since_step,))


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
