"""The hang watchdog across 128 simulated nodes of 8 ranks: how soon after the stall the culprit
is named, how soon every node acts on the verdict, and the store operations per poll interval
before and during the stall.

Each node runs the real `HangWatch` (its own thread, its own client of one TCPStore, the real
`NodeExchange` and `diagnose`); only its flight-log headers are synthetic, so 1,024 ranks fit on
2 cores: every rank completes all-reduce after all-reduce until the stall, then all but the
culprit enter the next one and the culprit computes on (a `compute` hang). Node 0 is the job's
judge; the others answer its request and follow its verdict.

    .venv/bin/python benchmarks/hang_scale.py [--nodes 128 --per-node 8 --runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
from _common import machine

from fixtures.ports import free_port_range
from meshscope.collector.flightread import FlightRecord, FlightTail
from meshscope.watchdog.config import HangConfig
from meshscope.watchdog.exchange import NodeExchange
from meshscope.watchdog.watch import HangWatch

STEP_S = 0.1


class CountingStore:
    """A store client that counts the operations it is asked for."""

    def __init__(self, store: dist.TCPStore, counter: list[int]) -> None:
        self.store, self.counter = store, counter

    def __getattr__(self, name: str):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.counter[0] += 1
            return method(*args, **kwargs)

        return counted


class Job:
    """The ranks' state as their flight logs would say it: healthy until `stall()`."""

    def __init__(self, world: int, culprit: int) -> None:
        self.world, self.culprit = world, culprit
        self.stalled_at: float | None = None
        self.seq = 100

    def stall(self) -> None:
        self.stalled_at = time.time()

    def tail(self, rank: int) -> FlightTail:
        now = time.time()
        progress = self.stalled_at or now
        records = [self._record(s, now, "completed") for s in range(self.seq - 4, self.seq)]
        if self.stalled_at is not None and rank != self.culprit:
            records.append(self._record(self.seq, self.stalled_at, "started"))
        return FlightTail(
            path=Path(f"/sim/rank{rank}"),
            rank=rank,
            world_size=self.world,
            pid=os.getpid(),
            step=self.seq,
            progress_t=progress,
            started_t=now - 60,
            step_s=STEP_S,
            closed=False,
            last_error="",
            attempt=0,
            records=records,
        )

    def _record(self, seq: int, t: float, state: str) -> FlightRecord:
        return FlightRecord(
            seq=seq,
            step=seq,
            t_issue=t,
            t_done=t if state == "completed" else 0.0,
            group="0",
            op="all_reduce",
            state=state,
            dtype="float32",
            shapes="[4096]",
            splits="",
            site="",
            peer=-1,
            group_size=self.world,
        )


class SimulatedNode(HangWatch):
    """A node's real watchdog over synthetic headers (no files, no stacks to ask for)."""

    def __init__(self, job: Job, ranks: range, live_dir: Path, **kwargs) -> None:
        super().__init__(live_dir, **kwargs)
        self.job, self.ranks = job, ranks

    def _heads(self):
        return {r: self.job.tail(r) for r in self.ranks}

    def _local_picture(self, heads, live):
        return heads, {}, {}


def run_once(nodes: int, per_node: int, quiet_s: float, every_node_judges: bool = False) -> dict:
    """One stall; `every_node_judges`: the design before the job's judge (each node asked all)."""
    world = nodes * per_node
    culprit = world - 3  # on the last node: never the judge's own
    port = free_port_range(1)
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    job = Job(world, culprit)
    counter = [0]
    found: dict[int, float] = {}
    verdicts: dict[int, list[int]] = {}
    config = HangConfig()
    live = Path(tempfile.mkdtemp(prefix="ms-hang-scale-"))
    watches = []
    for n in range(nodes):
        client = CountingStore(dist.TCPStore("127.0.0.1", port, is_master=False), counter)

        def on_hang(diag, n=n):
            found.setdefault(n, time.time())
            verdicts[n] = diag.culprit_ranks

        watches.append(
            SimulatedNode(
                job,
                range(n * per_node, (n + 1) * per_node),
                live,
                config=config,
                on_hang=on_hang,
                exchange=NodeExchange(client, prefix="job/bench/hang"),
                judge=(lambda n=n: every_node_judges or n == 0),
            ).start()
        )
    time.sleep(quiet_s)
    counter[0] = 0
    time.sleep(quiet_s)
    quiet_ops = counter[0] / (quiet_s / config.poll_s)
    counter[0] = 0
    job.stall()
    deadline = time.time() + 30
    while len(found) < nodes and time.time() < deadline:
        time.sleep(0.05)
    stall_ops = counter[0]
    for w in watches:
        w.stop()
    del master
    return {
        "named_s": found.get(0, float("inf")) - job.stalled_at,
        "all_acted_s": max(found.values(), default=float("inf")) - job.stalled_at,
        "acted": len(found),
        "right": all(v == [culprit] for v in verdicts.values()) and len(verdicts) == nodes,
        "quiet_ops_per_poll": quiet_ops,
        "stall_ops": stall_ops,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quiet", type=float, default=3.0, help="seconds of healthy polling measured")
    args = ap.parse_args()
    floor = HangConfig().min_stall_s
    print(f"machine: {machine()}; {args.nodes} nodes x {args.per_node} ranks; floor {floor} s")
    ours, before = [], []
    for _ in range(args.runs):  # interleaved: both designs meet the machine in the same state
        ours.append(run_once(args.nodes, args.per_node, args.quiet))
        before.append(run_once(args.nodes, args.per_node, args.quiet, every_node_judges=True))
    for label, rows in (("one judge", ours), ("every node judges (the design before)", before)):
        print(label)
        for r in rows:
            print(
                f"  named {r['named_s']:.2f} s after the stall, all {r['acted']} nodes acted by "
                f"{r['all_acted_s']:.2f} s, right culprit everywhere: {r['right']}; store ops per poll "
                f"interval {r['quiet_ops_per_poll']:.0f} healthy, {r['stall_ops']} for the whole stall",
                flush=True,
            )

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(
        f"median: named {med(ours, 'named_s'):.2f} s (target <= 5 s), every node acting "
        f"{med(ours, 'all_acted_s'):.2f} s; {med(ours, 'quiet_ops_per_poll'):.0f} ops per interval "
        f"while healthy; {med(ours, 'stall_ops'):.0f} ops for the stall vs {med(before, 'stall_ops'):.0f} "
        f"when every node judges (named {med(before, 'named_s'):.2f} s)"
    )


if __name__ == "__main__":
    main()
