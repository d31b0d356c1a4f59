"""The job store at 1,024 and 16,384 simulated ranks, 1 step/s: rows/s sustained, p99 commit
latency of a relay round, and how far the detection engine trails the newest step.

Every emulated node is what a real one is: its ranks' rows go into its own SQLite file (the
RunStore's schema and statement), and its relay (`collector/relay.py`, the real code) ships
them to a local PostgreSQL from Debian. One process and 2 cores play every node and the
server, so the relays share a pool of connections, as they would behind PgBouncer; a real job
runs each relay on its node. The engine (`DetectionEngine`, as `LiveDetection` drives it) reads
the job store each second and judges every step all ranks have recorded.

    .venv/bin/python benchmarks/job_store.py [--ranks 1024 16384 --seconds 30]
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from _common import machine

from fixtures.ports import free_port_range
from meshscope.collector.relay import StoreRelay
from meshscope.collector.schema import StepRecord
from meshscope.collector.store import _INSERT, _STEP_ROW, RELAY_TABLES, load_steps, open_store, store_path
from meshscope.collector.storedb import StoreTarget, job_schema, pg_connect, write_locator
from meshscope.dashboards import postgres
from meshscope.detectors.engine import DetectionEngine


class PooledRelay(StoreRelay):
    """A relay that borrows a connection for its round (PgBouncer's transaction pooling)."""

    def __init__(self, *args, pool: queue.Queue, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pool = pool
        self.latencies: list[float] = []

    def _connect(self):
        self._conn = self.pool.get()
        if self._positions is None:
            self._positions = {}
        self._t0 = time.perf_counter()
        return self._conn

    def _release(self, conn) -> None:
        self.latencies.append(time.perf_counter() - self._t0)
        self.pool.put(conn)
        self._conn = None


def rank_rows(ranks: range, world: int, step: int) -> list[tuple]:
    now = time.time()
    return [
        _STEP_ROW(
            StepRecord(run_id="bench", rank=r, world_size=world, step=step, time=now, step_s=1.0, loss=2.0)
        )
        for r in ranks
    ]


def run(ranks: int, per_node: int, seconds: float, workers: int, pool_size: int, server) -> dict:
    job = f"bench{ranks}"
    target = StoreTarget(server.url, job_schema(job), str(server.password_file))
    root = Path(tempfile.mkdtemp(prefix="ms-jobstore-"))
    nodes = ranks // per_node
    dirs = [root / f"node{n}" / job for n in range(nodes)]
    conns = []
    for d in dirs:
        write_locator(d, target)
        conns.append(open_store(d))
    pool: queue.Queue = queue.Queue()
    for _ in range(pool_size):
        pool.put(pg_connect(target, create=True))
    relays = [PooledRelay(store_path(d), target, RELAY_TABLES, pool=pool) for d in dirs]
    written: dict[int, float] = {}  # step -> when its last rank's row was on its node's disk
    stop = threading.Event()
    lags: list[float] = []
    behind: list[int] = []

    def ranks_write() -> None:
        step = 0
        start = time.monotonic()
        while not stop.is_set():
            for n, conn in enumerate(conns):
                with conn:
                    conn.executemany(
                        _INSERT["step"], rank_rows(range(n * per_node, (n + 1) * per_node), ranks, step)
                    )
            written[step] = time.time()
            step += 1
            time.sleep(max(0.0, start + step - time.monotonic()))  # 1 step/s

    def relay_worker(mine: list[PooledRelay]) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            for relay in mine:
                relay.ship_once()
            time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))

    def engine_loop() -> None:
        engine = DetectionEngine()
        while not stop.wait(1.0):
            steps = load_steps(dirs[0], since_step=engine.last_step)
            engine.process(steps)
            now = time.time()
            done = engine.last_step
            if done in written:
                lags.append(now - written[done])
            behind.append(max(written, default=-1) - done)

    threads = [threading.Thread(target=ranks_write, daemon=True)]
    threads += [
        threading.Thread(target=relay_worker, args=(relays[i::workers],), daemon=True) for i in range(workers)
    ]
    threads.append(threading.Thread(target=engine_loop, daemon=True))
    t0 = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    elapsed = time.monotonic() - t0
    with pg_connect(target) as conn:
        stored = conn.execute("SELECT count(*) FROM steps").fetchone()[0]
        for relay in relays:  # what was in flight at the stop: every row arrives
            relay.ship_once()
        arrived = conn.execute("SELECT count(*) FROM steps").fetchone()[0]
    offered = len(written) * ranks
    latencies = [x for r in relays for x in r.latencies]
    for c in conns:
        c.close()
    while not pool.empty():
        pool.get().close()
    shutil.rmtree(root, ignore_errors=True)
    return {
        "ranks": ranks,
        "nodes": nodes,
        "offered_rows_s": offered / elapsed,
        "stored_rows_s": stored / elapsed,
        "arrived_fraction": arrived / max(offered, 1),
        "commit_p50_ms": 1e3 * float(np.percentile(latencies, 50)),
        "commit_p99_ms": 1e3 * float(np.percentile(latencies, 99)),
        "engine_lag_s": float(np.median(lags)) if lags else float("nan"),
        "engine_lag_p99_s": float(np.percentile(lags, 99)) if lags else float("nan"),
        "engine_behind_steps_max": max(behind[2:], default=-1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024, 16384])
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--workers", type=int, default=4, help="threads that play the nodes' relays")
    ap.add_argument("--pool", type=int, default=8, help="connections the relays share")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="ms-pg-bench-"))
    home.chmod(0o711)
    server = postgres.start(home, free_port_range(1))
    postgres.wait_ready(server)
    print(f"machine: {machine()}; PostgreSQL from {postgres.find_pg_binary('pg_ctl')}; pid {os.getpid()}")
    try:
        for ranks in args.ranks:
            r = run(ranks, args.per_node, args.seconds, args.workers, args.pool, server)
            print(
                f"{r['ranks']:>6} ranks ({r['nodes']} nodes): offered {r['offered_rows_s']:,.0f} rows/s, "
                f"stored {r['stored_rows_s']:,.0f} rows/s ({r['arrived_fraction']:.1%} arrived); "
                f"relay round commit p50 {r['commit_p50_ms']:.1f} ms, p99 {r['commit_p99_ms']:.1f} ms; "
                f"engine lag median {r['engine_lag_s']:.2f} s, p99 {r['engine_lag_p99_s']:.2f} s, at most "
                f"{r['engine_behind_steps_max']} step(s) behind",
                flush=True,
            )
    finally:
        postgres.stop(home)
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
