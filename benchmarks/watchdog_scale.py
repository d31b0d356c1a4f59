"""The heartbeat watchdog at 1,024 and 16,384 ranks against one TCPStore: store operations per
second and detection delay, the old design (every rank reads every peer) against the new (each
rank writes, one watcher per node reads its ranks, one per job reads the nodes).

1. The store's capacity: client threads doing set/get as fast as they can.
2. Operations per heartbeat interval each design needs, and the series it exports.
3. The new design run for real: simulated ranks beat (one `set` each per interval), one
   `NodeWatch` per node of `--per-node` ranks, one `JobWatch`; at a known time one rank stops
   beating, later a whole node (its ranks and its watcher) goes: measured delay to each report.
   The old design cannot be run at these sizes (it needs more operations than the store
   serves); one of its rank's sweeps is timed instead.

    .venv/bin/python benchmarks/watchdog_scale.py [--ranks 1024 16384 --interval 1.0]
"""

from __future__ import annotations

import argparse
import threading
import time

import torch.distributed as dist
from _common import machine

from fixtures.ports import free_port_range
from meshscope.trainer.heartbeat import JobWatch, NodeWatch, connect_store, hb_key


def capacity(port: int, threads: int = 8, seconds: float = 1.5) -> float:
    """Store operations per second the store serves to `threads` clients."""
    counts = [0] * threads
    stop = time.monotonic() + seconds

    def client(i: int) -> None:
        store = connect_store("127.0.0.1", port)
        while time.monotonic() < stop:
            store.set(f"cap/{i}", "1.0 5")
            store.get(f"cap/{i}")
            counts[i] += 2

    pool = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return sum(counts) / seconds


def old_sweep_s(port: int, ranks: int) -> float:
    """One rank's look at every peer (check + get each), as the old watchdog did."""
    store = connect_store("127.0.0.1", port)
    for r in range(ranks):
        store.set(hb_key(99, r), "1.0 5")
    start = time.perf_counter()
    for r in range(1, ranks):
        key = hb_key(99, r)
        if store.check([key]):
            store.get(key)
    return time.perf_counter() - start


class Simulation:
    """N simulated ranks, their node watchers and the job watcher, on one store."""

    def __init__(self, port: int, ranks: int, per_node: int, interval: float, threads: int):
        self.port, self.interval, self.threads = port, interval, threads
        self.nodes = {
            n: list(range(n * per_node, min((n + 1) * per_node, ranks))) for n in range(-(-ranks // per_node))
        }
        self.ranks = ranks
        self.silent: set[int] = set()  # ranks that stopped beating
        self.gone_nodes: set[int] = set()  # nodes whose watcher stopped
        self.reports: dict[int, float] = {}
        self.ops = 0
        self.lag = 0.0  # worst overrun of an interval by a beat sweep
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def _report(self, rank: int, age: float, step: int) -> None:
        with self._lock:
            self.reports.setdefault(rank, time.monotonic())

    def _count(self, n: int) -> None:
        with self._lock:
            self.ops += n

    def _beater(self, mine: list[int]) -> None:
        store = connect_store("127.0.0.1", self.port)
        step = 0
        while not self._stop.is_set():
            start = time.monotonic()
            step += 1
            live = [r for r in mine if r not in self.silent]
            for r in live:
                store.set(hb_key(0, r), f"{time.time()} {step}")
            self._count(len(live))
            took = time.monotonic() - start
            self.lag = max(self.lag, took - self.interval)
            self._stop.wait(max(0.0, self.interval - took))

    def _watcher(self, nodes: list[int]) -> None:
        store = connect_store("127.0.0.1", self.port)
        watchers = {
            n: NodeWatch(
                store, attempt=0, node=n, ranks=self.nodes[n], interval_s=self.interval, on_dead=self._report
            )
            for n in nodes
        }
        while not self._stop.is_set():
            start = time.monotonic()
            for n, w in watchers.items():
                if n not in self.gone_nodes:
                    w.look()
                    self._count(4)  # check, multi_get, set (and the exit check, rarely)
            self._stop.wait(max(0.0, self.interval / 2 - (time.monotonic() - start)))

    def _job(self) -> None:
        job = JobWatch(
            connect_store("127.0.0.1", self.port),
            attempt=0,
            nodes=self.nodes,
            interval_s=self.interval,
            on_dead=self._report,
        )
        while not self._stop.wait(self.interval / 2):
            job.look()
            self._count(2)

    def run(self, settle_s: float, after_s: float) -> dict:
        ranks = list(range(self.ranks))
        nodes = list(self.nodes)
        slices = [ranks[i :: self.threads] for i in range(self.threads)]
        node_slices = [nodes[i :: max(1, self.threads // 2)] for i in range(max(1, self.threads // 2))]
        pool = (
            [threading.Thread(target=self._beater, args=(s,), daemon=True) for s in slices]
            + [threading.Thread(target=self._watcher, args=(s,), daemon=True) for s in node_slices]
            + [threading.Thread(target=self._job, daemon=True)]
        )
        for t in pool:
            t.start()
        time.sleep(settle_s)
        ops_before, t_before = self.ops, time.monotonic()
        victim = self.ranks // 2 + 1  # not a node's first rank
        dead_node = len(self.nodes) - 1
        t_rank = time.monotonic()
        self.silent.add(victim)
        time.sleep(after_s)
        t_node = time.monotonic()
        self.gone_nodes.add(dead_node)
        self.silent.update(self.nodes[dead_node])
        time.sleep(after_s)
        ops_rate = (self.ops - ops_before) / (time.monotonic() - t_before)
        self._stop.set()
        for t in pool:
            t.join(timeout=10)
        node_reports = [self.reports[r] for r in self.nodes[dead_node] if r in self.reports]
        return {
            "rank_delay": self.reports.get(victim, float("nan")) - t_rank,
            "node_delay": (min(node_reports) - t_node) if node_reports else float("nan"),
            "ops_per_s": ops_rate,
            "lag": self.lag,
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024, 16384])
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--interval", type=float, default=1.0, help="heartbeat interval, s")
    ap.add_argument("--threads", type=int, default=8, help="client threads simulating ranks")
    args = ap.parse_args()
    port = free_port_range(1)
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    cap = capacity(port)
    print(
        f"# {machine()}\n# one TCPStore serves {cap:,.0f} ops/s to 8 client threads; "
        f"interval {args.interval:g} s, {args.per_node} ranks per node"
    )
    print(
        f"{'ranks':>6} {'old ops/s':>13} {'old/capacity':>12} {'old sweep':>10} {'old series':>11}"
        f" | {'new ops/s':>10} {'measured':>9} {'series':>7} {'rank dead→report':>17}"
        f" {'node dead→report':>17} {'beat lag':>9}"
    )
    for ranks in args.ranks:
        nodes = -(-ranks // args.per_node)
        old = (ranks + 4 * ranks * (ranks - 1)) / args.interval
        new = (ranks + 8 * nodes + 4) / args.interval
        sweep = old_sweep_s(port, ranks)
        sim = Simulation(port, ranks, args.per_node, args.interval, args.threads).run(
            settle_s=3 * args.interval, after_s=4 * args.interval
        )
        print(
            f"{ranks:>6} {old:13,.0f} {old / cap:11.0f}x {sweep:9.2f}s {ranks * (ranks - 1):11,}"
            f" | {new:10,.0f} {sim['ops_per_s']:9,.0f} {ranks:7,} {sim['rank_delay']:16.2f}s"
            f" {sim['node_delay']:16.2f}s {sim['lag']:8.2f}s",
            flush=True,
        )
    print("old sweep: one rank reading every peer once; every rank does it each half interval")
    del master


if __name__ == "__main__":
    main()
