"""The relay: a node's store, shipped to the job store.

Ranks always write their node's SQLite file (no network in a rank's process, no database
client in the Monitor). One relay per node copies what is new to the job store on PostgreSQL
in one transaction per round, and records how far it got in the same transaction — so a row
is shipped exactly once even if the relay is killed mid-round, a server that is down costs one
warning and a backlog on the node's disk (lost only with the disk), and the job store holds one
connection per node rather than one per rank.

After a connection error the positions are read back from the server, which committed them
with the rows (a commit whose reply was lost is not shipped again); unkeyed rows (events)
carry a natural key there besides, so even a second shipper of one file adds nothing.

Rows are found by SQLite rowid. A keyed row written again (a step after a restart) is deleted
and reinserted with a new rowid, at worst the one last shipped: the relay ships from that rowid
inclusive, and the job store replaces on the same key, so a rewrite is never missed.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshscope.collector.service import Service
from meshscope.collector.storedb import (
    StoreTarget,
    StoreUnavailable,
    insert_sql,
    pg_connect,
    pg_sql,
    sqlite_connect,
)

log = logging.getLogger("meshscope.relay")

BATCH_ROWS = 20_000  # per table per round: a backlog drains over rounds, never one huge transaction


class StoreRelay(Service):
    """Ships one node's SQLite store to the job store every `interval_s`, in a thread."""

    def __init__(
        self,
        store_file: Path,
        target: StoreTarget,
        tables: dict[str, tuple[tuple[str, ...], bool]],
        *,
        interval_s: float = 0.5,
        close_retry_s: float = 30.0,
        active: Callable[[], bool] = lambda: True,
    ) -> None:
        self.store_file, self.target, self.interval_s = Path(store_file), target, interval_s
        self.close_retry_s = close_retry_s
        self.active = active  # agents sharing one store file: one of them ships it
        # (columns, keyed): keyed tables are replaced on their key, the others appended
        self.tables = tables
        self.source = ""  # which store file this is (set once it exists; see `ship_once`)
        self.shipped = 0  # rows, since start
        self._positions: dict[str, int] | None = None
        self._conn: Any = None
        self._down_since: float | None = None
        # one round at a time: a caller's drain() may run while the thread ships on the same session
        self._round = threading.Lock()
        super().__init__("meshscope-relay", interval_s, join_s=60)

    def drain(self, retry_s: float = 0.0) -> bool:
        """Ship until nothing is new (retrying a job store that is down for `retry_s`); False
        when rows remain on the node only (not lost: the next relay of this store ships them)."""
        if not self.active():
            return True
        deadline = time.monotonic() + retry_s
        while True:
            try:
                while self.ship_once():  # a backlog takes several rounds
                    pass
                return True
            except StoreUnavailable as err:
                if time.monotonic() > deadline:
                    log.error("%s: rows not shipped stay in %s for the next relay", err, self.store_file)
                    return False
                time.sleep(0.5)

    def stop(self) -> bool:
        """Ship what is left, then close (see `drain`)."""
        super().stop()
        shipped = self.drain(self.close_retry_s)
        with self._round:
            self._reset()
        return shipped

    def round(self) -> None:
        """Ship what is new, if this agent ships this store (other failures: `Service`)."""
        if not self.active():
            return
        try:
            self.ship_once()
        except StoreUnavailable as err:
            if self._down_since is None:  # one warning per outage
                self._down_since = time.monotonic()
                log.warning("%s; the node's rows wait in %s until it answers", err, self.store_file)

    def ship_once(self) -> int:
        """One round: every table's new rows and the new positions, in one transaction."""
        with self._round:
            return self._ship_round()

    def _ship_round(self) -> int:
        import psycopg

        if not self.store_file.exists():
            return 0
        if not self.source:  # the inode too: a folder deleted and made again is another source
            inode = self.store_file.stat().st_ino
            self.source = f"{socket.gethostname()}:{self.store_file.resolve()}:{inode}"
        try:
            conn = self._connect()
            local = sqlite_connect(self.store_file, readonly=True)
            try:
                with conn.transaction():
                    moved, positions = self._copy(conn, local)
            finally:
                local.close()
                self._release(conn)
        except (psycopg.OperationalError, psycopg.InterfaceError) as err:
            self._reset()
            # a commit whose reply was lost did land: the server's positions say how far
            self._positions = None
            first_line = str(err).strip().splitlines()[0]
            raise StoreUnavailable(f"job store {self.target.url}: {first_line}") from None
        self._positions = positions  # only once committed
        self.shipped += moved
        if self._down_since is not None and moved:
            log.warning("job store answers again after %.1f s", time.monotonic() - self._down_since)
            self._down_since = None
        return moved

    def _copy(self, conn: Any, local: Any) -> tuple[int, dict[str, int]]:
        import sqlite3

        positions = dict(self._positions or {})
        moved = 0
        with conn.cursor() as cur:
            for table, (columns, keyed) in self.tables.items():
                start = positions.get(table, 0)
                names = ",".join(f'"{c}"' for c in columns)
                op = ">=" if keyed else ">"  # keyed: the last shipped rowid may have been rewritten
                try:
                    rows = local.execute(
                        f"SELECT rowid, {names} FROM {table} WHERE rowid {op} ? ORDER BY rowid LIMIT ?",
                        (start, BATCH_ROWS),
                    ).fetchall()
                except sqlite3.OperationalError:  # a table this store does not have yet
                    continue
                if not rows:
                    continue
                statement = pg_sql(insert_sql("postgresql", table, columns, replace=keyed))
                statement += "" if keyed else " ON CONFLICT DO NOTHING"  # events: their natural key
                cur.executemany(statement, [r[1:] for r in rows])  # pipelined: one round trip
                positions[table] = rows[-1][0]
                moved += sum(1 for r in rows if r[0] > start)  # the boundary row again is not news
                cur.execute(
                    "INSERT INTO relay_positions (source, tbl, position) VALUES (%s, %s, %s) "
                    "ON CONFLICT (source, tbl) DO UPDATE SET position = EXCLUDED.position",
                    (self.source, table, positions[table]),
                )
        return moved, positions

    def _connect(self) -> Any:
        if self._conn is None or self._conn.closed:
            self._conn = pg_connect(self.target, create=True)
            if self._positions is None:  # a relay restarted: go on where the last one committed
                rows = self._conn.execute(
                    "SELECT tbl, position FROM relay_positions WHERE source = %s", (self.source,)
                ).fetchall()
                self._positions = {t: int(p) for t, p in rows}
        return self._conn

    def _release(self, conn: Any) -> None:
        """After a round (kept for the next one; a pooled relay hands it back here)."""

    def _reset(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
