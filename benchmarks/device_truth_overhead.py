"""Device-event recording: what device truth costs the step, against the flight log's host
bookkeeping, alternating in blocks in the same processes, on the simulated accelerator.

Variants (each its own copy of the DDP MoE loop, all through the flight log's Python
all-reduce hook, on `simnccl`):
- `host`: the flight log without a device probe (it takes the future for completion, as it
  did before device truth; the baseline; `control`, a second copy, gives the noise floor);
- `device`: the flight log with the device probe: every collective's Work queried by the log's
  own thread, an event after each blocking collective and at each step end (target <= 1.01).

Printed: each variant's median step time over the host copies' (host and control pooled).

    .venv/bin/python benchmarks/device_truth_overhead.py [--ranks 2 --blocks 6 --block-steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from _common import machine, run_ranks, timed_blocks

VARIANTS = ("host", "control", "device")


def bench(rank: int, world_size: int, blocks: int, block_steps: int, run_dir: str, d_model: int) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from meshscope.collector.flightlog import FlightLog, allreduce_hook
    from meshscope.trainer.config import ModelConfig
    from meshscope.trainer.data import SyntheticTokens
    from meshscope.trainer.device import Device
    from meshscope.trainer.model import MoELM

    probe = Device("sim", rank, "simnccl").probe()
    cfg = ModelConfig(vocab_size=128, seq_len=32, layers=2, d_model=d_model, heads=4, experts=8, top_k=2)
    data = SyntheticTokens(vocab_size=128, seq_len=32, batch_size=8, seed=0, rank=rank, world_size=world_size)
    logs = {
        v: FlightLog(
            f"{run_dir}/{v}", rank=rank, world_size=world_size, probe=probe if v == "device" else None
        )
        for v in VARIANTS
    }
    logs["host"].install()
    FlightLog._active = None

    def make():
        torch.manual_seed(0)
        model = MoELM(cfg)
        ddp = DDP(model, bucket_cap_mb=1.0)
        ddp.register_comm_hook(None, allreduce_hook)
        return model, ddp, torch.optim.AdamW(model.parameters(), 1e-3, fused=True)

    def step(variant, model, ddp, opt, i):
        log = FlightLog._active = logs[variant]
        log.step_begin(i)
        x, y = data.batch(i)
        loss, _ = model.loss(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        log.step_end(probe.mark())
        FlightLog._active = None

    built = {v: make() for v in VARIANTS}
    for i in range(3):
        for v in VARIANTS:
            step(v, *built[v], i)
    times = timed_blocks(VARIANTS, built, step, blocks, block_steps, {v: [] for v in VARIANTS})
    probe_done = probe.mark()
    probe.wait(probe_done)
    for log in logs.values():
        log.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--block-steps", type=int, default=8)
    ap.add_argument("--d-model", type=int, nargs="+", default=[64, 256])
    args = ap.parse_args()
    print(
        f"# {machine()}\n# {args.ranks} simnccl ranks, {args.blocks} blocks x {args.block_steps} "
        "steps per variant; rank 0's median step time"
    )
    print(f"{'d_model':>7} {'host ms':>9} {'control':>9} {'device':>9}")
    for d_model in args.d_model:
        with tempfile.TemporaryDirectory() as run_dir:
            times = run_ranks(
                bench,
                args.ranks,
                backend="simnccl",
                blocks=args.blocks,
                block_steps=args.block_steps,
                run_dir=run_dir,
                d_model=d_model,
            )[0]
        base = statistics.median(times["host"] + times["control"])
        ratios = {v: statistics.median(times[v]) / base for v in ("control", "device")}
        print(f"{d_model:>7} {base * 1e3:9.2f} {ratios['control']:9.3f} {ratios['device']:9.3f}", flush=True)


if __name__ == "__main__":
    main()
