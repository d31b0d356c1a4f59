"""Hierarchical against flat gradient all-reduce across emulated nodes with a limited link.

Two nodes (network namespaces on a bridge, `fixtures/netns.py`) of two gloo ranks each; every
node's link is rate-limited with `tc tbf` (`--rate`); ranks on one node talk locally.
In the same processes, two DDP copies of the reference MoE LM step in alternating blocks: `flat`
(one all-reduce over all four ranks) and `hierarchical` (reduce-scatter in the node,
all-reduce of each shard across nodes, all-gather in the node; `trainer/hierarchy.py`).
Printed: median step time of each and their ratio, and inter-node bytes per rank per step as
the link counted them (the node interface's tx bytes during each variant's blocks).

    .venv/bin/python benchmarks/hierarchical_allreduce.py [--rate 200mbit --blocks 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, machine, timed_blocks

VARIANTS = ("flat", "hierarchical")


def tx_bytes(interface: str) -> int:
    """What this node's interface has sent so far."""
    return int(Path(f"/sys/class/net/{interface}/statistics/tx_bytes").read_text())


def worker(args: argparse.Namespace) -> None:
    """One rank: both copies, alternating blocks; local rank 0 counts the node's tx bytes."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from meshscope.collector.flightlog import allreduce_hook
    from meshscope.trainer.config import ModelConfig
    from meshscope.trainer.data import SyntheticTokens
    from meshscope.trainer.hierarchy import hierarchical_hook, node_groups
    from meshscope.trainer.model import MoELM

    torch.set_num_threads(1)
    store = dist.TCPStore(args.master, args.port, args.world, is_master=args.rank == 0)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world)
    groups = node_groups(args.local)
    cfg = ModelConfig(vocab_size=128, seq_len=32, layers=2, d_model=args.d_model, heads=4, experts=8, top_k=2)
    data = SyntheticTokens(
        vocab_size=128, seq_len=32, batch_size=8, seed=0, rank=args.rank, world_size=args.world
    )

    def make(variant):
        torch.manual_seed(0)
        model = MoELM(cfg)
        ddp = DDP(model, bucket_cap_mb=1.0)
        if variant == "flat":
            ddp.register_comm_hook(None, allreduce_hook)
        else:
            ddp.register_comm_hook(groups, hierarchical_hook)
        return model, ddp, torch.optim.AdamW(model.parameters(), 1e-3, fused=True)

    def step(variant, model, ddp, opt, i):
        x, y = data.batch(i)
        model.loss(ddp(x), y)[0].backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    built = {v: make(v) for v in VARIANTS}
    for i in range(2):
        for v in VARIANTS:
            step(v, *built[v], i)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    sent = {v: 0 for v in VARIANTS}
    counting = args.rank % args.local == 0
    for b in range(args.blocks):
        for v in VARIANTS[b % 2 :] + VARIANTS[: b % 2]:
            dist.barrier()
            before = tx_bytes(args.interface) if counting else 0
            timed_blocks((v,), built, step, 1, args.block_steps, times)
            dist.barrier()
            sent[v] += (tx_bytes(args.interface) - before) if counting else 0
    dist.barrier()
    if args.rank == 0 or counting:
        Path(args.out, f"rank{args.rank}.json").write_text(json.dumps({"times": times, "sent": sent}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="200mbit")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--block-steps", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=128)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from fixtures.netns import nodes
    from fixtures.ports import free_port_range

    port, local, world = free_port_range(1), 2, 4
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    with nodes(2) as pair, tempfile.TemporaryDirectory() as out:
        for node in pair:
            node.limit(args.rate)
        procs = []
        for rank in range(world):
            node = pair[rank // local]
            cmd = node.command(
                *(sys.executable, __file__, "worker", "--rank", str(rank), "--world", str(world)),
                *("--local", str(local), "--master", pair[0].address, "--port", str(port)),
                *("--interface", node.veth, "--out", out, "--blocks", str(args.blocks)),
                *("--block-steps", str(args.block_steps), "--d-model", str(args.d_model)),
            )
            procs.append(subprocess.Popen(cmd, cwd=REPO, env={**env, "GLOO_SOCKET_IFNAME": node.veth}))
            time.sleep(0.2)
        for p in procs:
            p.wait(timeout=900)
        reports = {int(f.stem[4:]): json.loads(f.read_text()) for f in Path(out).glob("rank*.json")}
    times = reports[0]["times"]
    steps = args.blocks * args.block_steps
    per_rank = {v: sum(r["sent"][v] for r in reports.values()) / world / steps for v in VARIANTS}
    flat, hier = (statistics.median(times[v]) for v in VARIANTS)
    print(f"# {machine()}\n# 2 nodes x 2 gloo ranks, node links {args.rate}, d_model {args.d_model}")
    print(f"{'variant':13} {'step ms':>9} {'inter-node KB/rank/step':>24}")
    for v, t in zip(VARIANTS, (flat, hier)):
        print(f"{v:13} {t * 1e3:9.1f} {per_rank[v] / 1024:24.1f}")
    print(
        f"hierarchical / flat: step time {hier / flat:.3f}, "
        f"inter-node bytes {per_rank['hierarchical'] / per_rank['flat']:.3f}"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        wp = argparse.ArgumentParser()
        for name in ("rank", "world", "local", "port", "blocks", "block-steps", "d-model"):
            wp.add_argument(f"--{name}", type=int)
        for name in ("master", "interface", "out"):
            wp.add_argument(f"--{name}")
        worker(wp.parse_args(sys.argv[2:]))
    else:
        main()
