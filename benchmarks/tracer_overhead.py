"""Debugging overhead: the collective flight log and the tensor tracer's modes, against the same
DDP MoE loop without them, alternating in blocks in the same processes.

Variants (each its own model copy of the same architecture, built in rotating order):
- `plain`: DDP's C++ all-reduce, no hooks (the baseline; a second copy, `control`, gives this
  machine's noise floor in the same run);
- `flight`: the flight log on, DDP through its Python all-reduce hook (target <= 1.01);
- `nonfinite`, `stats`, `full`: the tensor tracer in that mode on the plain loop (targets
  <= 1.01, <= 1.03, <= 1.6); `stats` samples one step in 10, `full` hooks every step.

Printed: each variant's median step time over the plain copies' (plain and control pooled),
per model size.

`--ep 2`: the reference trainer's step with experts split over 2 ranks instead, `nonfinite`
against no tracer on the same model, alternating blocks; under expert parallelism the tracer
also reads what each exchange carried (`tracer.exchanges`), and that watch's CPU time a step
is printed.

    .venv/bin/python benchmarks/tracer_overhead.py [--ranks 2 --blocks 6 --block-steps 8] [--ep 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from _common import machine, run_ranks, timed_blocks

VARIANTS = ("plain", "control", "flight", "nonfinite", "stats", "full")


def bench(
    rank: int, world_size: int, blocks: int, block_steps: int, run_dir: str, d_model: int, copies: int
) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from meshscope.collector.flightlog import FlightLog, allreduce_hook
    from meshscope.tracer.trace import TensorTracer, TracerConfig
    from meshscope.trainer.config import ModelConfig
    from meshscope.trainer.data import SyntheticTokens
    from meshscope.trainer.model import MoELM

    cfg = ModelConfig(vocab_size=128, seq_len=32, layers=2, d_model=d_model, heads=4, experts=8, top_k=2)
    data = SyntheticTokens(vocab_size=128, seq_len=32, batch_size=8, seed=0, rank=rank, world_size=world_size)
    flight = FlightLog(f"{run_dir}/live", rank=rank, world_size=world_size).install()
    FlightLog._active = None  # on only while the flight variant steps

    def make(variant):
        torch.manual_seed(0)
        model = MoELM(cfg)
        ddp = DDP(model, bucket_cap_mb=25.0)
        if variant == "flight":
            ddp.register_comm_hook(None, allreduce_hook)
        tracer = None
        if variant in ("nonfinite", "stats", "full"):
            tracer = TensorTracer(model, TracerConfig(mode=variant), rank=rank)
        return model, ddp, torch.optim.AdamW(model.parameters(), 1e-3, fused=True), tracer

    def step(variant, model, ddp, opt, tracer, i):
        if variant == "flight":
            FlightLog._active = flight
            flight.step_begin(i)
        if tracer is not None:
            tracer.step_begin(i)
        x, y = data.batch(i)
        loss, _ = model.loss(ddp(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        if tracer is not None:
            tracer.step_end(loss=loss, grad_norm=norm, rerun=lambda: model.loss(model(x), y)[0])
        if variant == "flight":
            flight.step_end()
            FlightLog._active = None

    times = {v: [] for v in VARIANTS}
    for copy in range(copies):
        order = VARIANTS[copy % len(VARIANTS) :] + VARIANTS[: copy % len(VARIANTS)]
        built = {v: make(v) for v in order}
        for i in range(3):
            for v in VARIANTS:
                step(v, *built[v], i)
        timed_blocks(VARIANTS, built, step, blocks, block_steps, times)
    flight.close()
    return times


def bench_ep(
    rank: int, world_size: int, blocks: int, block_steps: int, run_dir: str, d_model: int, ep: int
) -> dict:
    """The trainer's expert-parallel step without a tracer and with `nonfinite` (its exchange
    watch on), alternating on one model; and the watch's own CPU time a step."""
    from pathlib import Path

    from prometheus_client import CollectorRegistry

    from meshscope.collector.env import DistEnv
    from meshscope.collector.monitor import Monitor
    from meshscope.collector.monitor_config import MonitorConfig
    from meshscope.tracer.exchanges import ExchangeWatch
    from meshscope.tracer.trace import TensorTracer, TracerConfig
    from meshscope.trainer.config import TrainerConfig
    from meshscope.trainer.device import Device
    from meshscope.trainer.inject import Injector
    from meshscope.trainer.loop import build, train_step

    model = {"experts": 8, "d_model": d_model, "heads": 4, "layers": 2, "seq_len": 32, "vocab_size": 128}
    cfg = TrainerConfig(nproc=world_size, parallel={"ep": ep}, model=model, train={"batch_size": 8})
    env = DistEnv(
        rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size, torchrun=True
    )
    config = MonitorConfig(run_dir=Path(run_dir) / str(rank), metrics_port=None, flight_log=False)
    mon = Monitor(config, env=env, registry=CollectorRegistry())
    dev = Device("cpu")
    dev.activate()
    state = build(cfg, dev, mon, rank=rank, world_size=world_size)
    spent = [0.0]

    def metered(fn):
        def timed(*args):
            start = time.thread_time()
            try:
                return fn(*args)
            finally:
                spent[0] += time.thread_time() - start

        return timed

    ExchangeWatch.seen, ExchangeWatch.take = metered(ExchangeWatch.seen), metered(ExchangeWatch.take)
    tracer = TensorTracer(state.model, TracerConfig(mode="nonfinite"), rank=rank)
    meshes = [layer.expert_mesh for layer in state.model.moe_layers()]
    watch = meshes[0].watch
    injector = Injector([], rank, lambda inj, step: None)

    def step(variant, *_):
        state.tracer = tracer if variant == "nonfinite" else None
        for mesh in meshes:
            mesh.watch = watch if variant == "nonfinite" else None
        train_step(state, mon, cfg, dev, injector)

    variants = ("plain", "nonfinite")
    for _ in range(3):
        for v in variants:
            step(v)
    spent[0] = 0.0
    times = timed_blocks(variants, {v: () for v in variants}, step, blocks, block_steps, {})
    tracer.close()
    mon.close()
    return {**times, "watch_us": spent[0] / len(times["nonfinite"]) * 1e6}


def nonfinite_cost_us(calls: int = 3000) -> float:
    """CPU time of the nonfinite tracer's per-step work (no hooks: RNG state, two scalars)."""
    import torch

    from meshscope.tracer.trace import TensorTracer, TracerConfig
    from meshscope.trainer.config import ModelConfig
    from meshscope.trainer.model import MoELM

    tracer = TensorTracer(MoELM(ModelConfig()), TracerConfig(mode="nonfinite"))
    loss, norm = torch.tensor(2.0), torch.tensor(1.0)
    start = time.thread_time()
    for i in range(calls):
        tracer.step_begin(i)
        tracer.step_end(loss=loss, grad_norm=norm, rerun=lambda: loss)
    return (time.thread_time() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--block-steps", type=int, default=8)
    ap.add_argument("--copies", type=int, default=3, help="fresh model sets, rotating order")
    ap.add_argument("--d-model", type=int, nargs="+", default=[64, 256])
    ap.add_argument(
        "--ep", type=int, default=1, help="experts split over this many ranks (the trainer's step)"
    )
    args = ap.parse_args()
    if args.ep > 1:
        return main_ep(args)
    print(
        f"# {machine()}\n# {args.ranks} gloo ranks, {args.copies} copies x {args.blocks} "
        f"blocks x {args.block_steps} steps per variant; rank 0's median step time"
    )
    print(f"{'d_model':>7} {'plain ms':>9} " + " ".join(f"{v:>10}" for v in VARIANTS[1:]))
    for d_model in args.d_model:
        times = rank0(bench, args, d_model, copies=args.copies)
        # two identical plain copies differ by a few percent (memory layout): the baseline is
        # both, and `control` shows how far one of them strays from it
        base = statistics.median(times["plain"] + times["control"])
        ratios = {v: statistics.median(times[v]) / base for v in VARIANTS[1:]}
        print(
            f"{d_model:>7} {base * 1e3:9.2f} " + " ".join(f"{ratios[v]:10.3f}" for v in VARIANTS[1:]),
            flush=True,
        )
    print(
        "targets: flight <= 1.01, nonfinite <= 1.01, stats <= 1.03, full <= 1.6 (control = the noise floor)"
    )
    print(f"nonfinite tracer's own cost: {nonfinite_cost_us():.1f} us of CPU per step")


def rank0(fn, args: argparse.Namespace, d_model: int, **extra) -> dict:
    """What rank 0 of `fn` returns, run on `args.ranks` ranks in a fresh run directory."""
    with tempfile.TemporaryDirectory() as run_dir:
        kw = {"blocks": args.blocks, "block_steps": args.block_steps, "run_dir": run_dir, "d_model": d_model}
        return run_ranks(fn, args.ranks, **kw, **extra)[0]


def main_ep(args: argparse.Namespace) -> None:
    """`--ep`: nonfinite against no tracer on the trainer's expert-parallel step."""
    print(
        f"# {machine()}\n# {args.ranks} gloo ranks, ep={args.ep}, "
        f"{args.blocks} blocks x {args.block_steps} steps per variant"
    )
    for d_model in args.d_model:
        got = rank0(bench_ep, args, d_model, ep=args.ep)
        base = statistics.median(got["plain"])
        ratio = statistics.median(got["nonfinite"]) / base
        print(
            f"d_model {d_model}: plain {base * 1e3:.2f} ms, nonfinite {ratio:.3f} "
            f"(target <= 1.01); the exchange watch {got['watch_us']:.0f} us of CPU a step",
            flush=True,
        )


if __name__ == "__main__":
    main()
