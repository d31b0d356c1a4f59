"""Monitor overhead: the same DDP MoE loop with the Monitor on and off, alternating in blocks.

Two models of the same architecture live in the same processes; one is watched (instrumented
comm hook, phase marks, records to the store), the other is plain DDP with its built-in C++
all-reduce. Blocks of steps alternate so drift and noise hit both. Two identical models differ
by a few percent through memory layout alone, so fresh pairs are built several times, in
alternating order, and the ratio is taken over all pairs. Target: step-time ratio on/off <= 1.01.

    .venv/bin/python benchmarks/overhead.py [--ranks 2 --pairs 4 --blocks 6 --block-steps 8]
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time

from _common import machine, run_ranks


def bench(rank: int, world_size: int, pairs: int, blocks: int, block_steps: int, run_dir: str,
          d_model: int, bucket_mb: float) -> dict:
    import torch
    from prometheus_client import CollectorRegistry
    from torch.nn.parallel import DistributedDataParallel as DDP

    from collector import DistEnv, Monitor, MonitorConfig
    from trainer.config import ModelConfig
    from trainer.data import SyntheticTokens
    from trainer.model import MoELM

    cfg = ModelConfig(vocab_size=128, seq_len=32, layers=2, d_model=d_model, heads=4, experts=8,
                      top_k=2)
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size)
    mon = Monitor(MonitorConfig(run_dir=run_dir, metrics_port=None, expert_every=5), env=env,
                  registry=CollectorRegistry())
    data = SyntheticTokens(vocab_size=128, seq_len=32, batch_size=8, seed=0, rank=rank,
                           world_size=world_size)

    def make():
        torch.manual_seed(0)
        model = MoELM(cfg)
        return model, DDP(model, bucket_cap_mb=bucket_mb), torch.optim.AdamW(model.parameters(), 1e-3)


    def step_plain(model, ddp, opt, i):
        x, y = data.batch(i)
        loss, lm = model.loss(ddp(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        return lm

    def step_watched(model, ddp, opt, i):
        with mon.step(tokens=256) as s:
            with s.phase("data"):
                x, y = data.batch(i)
            with s.phase("forward"):
                loss, lm = model.loss(ddp(x), y)
            with s.phase("backward"):
                loss.backward()
            with s.phase("optimizer"):
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=False)
            s.log(loss=lm, grad_norm=norm)

    times = {"on": [], "off": []}
    for pair in range(pairs):
        on, off = (make(), make()) if pair % 2 == 0 else reversed((make(), make()))
        mon.watch(on[1])
        for i in range(3):  # warm-up both
            step_plain(*off, i)
            step_watched(*on, i)
        for b in range(blocks):
            for mode in (("on", "off") if b % 2 == 0 else ("off", "on")):
                for i in range(block_steps):
                    t0 = time.perf_counter()
                    (step_watched if mode == "on" else step_plain)(*(on if mode == "on" else off), i)
                    times[mode].append(time.perf_counter() - t0)
    mon.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--block-steps", type=int, default=8)
    ap.add_argument("--d-model", type=int, nargs="+", default=[64, 256],
                    help="model widths to measure (64 = the demo model)")
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[25.0, 0.25],
                    help="DDP bucket caps: 25 = torch's default; 0.25 = many buckets, worst case")
    args = ap.parse_args()
    print(f"machine: {machine()}")
    print(f"ranks={args.ranks} pairs={args.pairs} blocks={args.blocks}x{args.block_steps} "
          "steps per mode per rank")
    for width, bucket_mb in itertools.product(args.d_model, args.bucket_mb):
        with tempfile.TemporaryDirectory() as d:
            results = run_ranks(bench, args.ranks, pairs=args.pairs, blocks=args.blocks,
                                block_steps=args.block_steps, run_dir=d, d_model=width,
                                bucket_mb=bucket_mb)
        on = [t for r in results for t in r["on"]]
        off = [t for r in results for t in r["off"]]
        ratio = statistics.median(on) / statistics.median(off)
        mean_ratio = statistics.mean(on) / statistics.mean(off)
        print(f"d_model={width:4d} bucket={bucket_mb:5.2f} MB  median step on {statistics.median(on) * 1e3:7.2f} ms  "
              f"off {statistics.median(off) * 1e3:7.2f} ms  ratio median {ratio:.4f}  "
              f"mean {mean_ratio:.4f}  (target <= 1.01)")


if __name__ == "__main__":
    main()
