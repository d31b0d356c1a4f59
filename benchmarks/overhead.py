"""Monitor overhead: the same DDP MoE loop with the Monitor on and off, alternating in blocks.

Three models of the same architecture live in the same processes: one watched by the Monitor
(phase marks, the wait after backward, expert counts, records to the store and /metrics
families), two plain (DDP's built-in C++ all-reduce). Blocks of steps rotate through the three,
so drift and noise hit all; fresh triples are built several times in rotating order, since two
identical models differ by a few percent through memory layout alone.

Printed per configuration:
- `on/off`: watched step time over the first plain model's in the same block, the median over
  blocks, with a 95 % bootstrap interval over blocks (target <= 1.01; the interval says
  whether this many alternations resolve 1 %);
- `control`: the second plain model over the first, likewise: the same code, so this is the
  noise floor of this machine, measured in the same invocation;
- `cost`: CPU time the Monitor itself spent per step on rank 0 (its context managers, hooks,
  autograd callbacks, its store-writer thread and the flight log's responder thread over the
  measured steps), and that cost over the plain step time: the overhead as an account rather
  than a difference of two noisy numbers.

    .venv/bin/python benchmarks/overhead.py [--ranks 2 --pairs 4 --blocks 6 --block-steps 8 --layers 2]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import tempfile
import time

from _common import machine, run_ranks


class CostMeter:
    """Thread CPU time spent inside wrapped callables (the Monitor's entry points)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.by_entry: dict[str, list[float]] = {}  # name -> [seconds, calls]: where it goes

    def add(self, name: str, seconds: float) -> None:
        self.seconds += seconds
        spent = self.by_entry.setdefault(name, [0.0, 0])
        spent[0] += seconds
        spent[1] += 1

    def wrap(self, fn):
        name = fn.__qualname__

        @functools.wraps(fn)  # annotations too: DDP checks a comm hook's
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.thread_time() - start)

        return timed

    def wrap_context(self, factory):
        meter = self
        name = factory.__qualname__

        class Timed:
            def __init__(self, *args, **kwargs):
                start = time.thread_time()
                self.inner = factory(*args, **kwargs)
                self.value = self.inner.__enter__()
                meter.add(f"{name} enter", time.thread_time() - start)

            def __enter__(self):
                return self.value

            def __exit__(self, *exc):
                start = time.thread_time()
                try:
                    return self.inner.__exit__(*exc)
                finally:
                    meter.add(f"{name} exit", time.thread_time() - start)

        def enter(*args, **kwargs):  # a function, so it binds as a method too
            return Timed(*args, **kwargs)

        return enter


def instrument_costs(mon, cost: CostMeter) -> None:
    """Route the Monitor's entry points through the cost meter (this process only)."""
    from meshscope.collector import comm, expert_counts, flightlog, monitor

    mon.step = cost.wrap_context(mon.step)
    monitor.StepScope.phase = cost.wrap_context(monitor.StepScope.phase)
    monitor.StepScope.log = cost.wrap(monitor.StepScope.log)
    # expert counts: their own forward hook on a plain model, inside the backward watch's on DDP
    expert_counts.ExpertCounts._on_forward = cost.wrap(expert_counts.ExpertCounts._on_forward)
    # the backward watch, with the flight log's one record of DDP's reduction a step
    for name in ("_on_forward", "_on_backward_start", "_on_local_backward", "_on_graph_done", "_on_reduced"):
        setattr(comm.BackwardWatch, name, cost.wrap(getattr(comm.BackwardWatch, name)))
    # the per-bucket path, where a Python comm hook runs: its record and completion callbacks
    flightlog._bucket_done = cost.wrap(flightlog._bucket_done)
    real_instrument = comm.instrument_hook
    monitor.instrument_hook = lambda *a, **k: cost.wrap(real_instrument(*a, **k))


def empty_bodies() -> None:
    """`--floor`: the Monitor's entry points keep their hooks, contexts and callbacks but do no
    work in them (no record, no flight log, no expert counts): what entering the Monitor 16
    times a step costs on this host, whatever an entry does. A diagnosis, not a Monitor."""
    import torch

    from meshscope.collector import comm, expert_counts, monitor
    from meshscope.collector.scope import StepScope

    queue = torch.autograd.Variable._execution_engine.queue_callback

    def begin(self, tokens, step):
        self._step += 1
        return StepScope(self.probe), time.time(), time.perf_counter()

    monitor.Monitor._begin = begin
    monitor.Monitor._end = lambda self, scope, tokens, wall, start: None
    expert_counts.ExpertCounts.forward_done = lambda self: None
    comm.BackwardWatch._on_backward_start = lambda self, grads: queue(self._on_graph_done)
    comm.BackwardWatch._on_graph_done = lambda self: queue(self._on_reduced)
    comm.BackwardWatch._on_reduced = lambda self: None


def thread_cpu(thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def bench(
    rank: int,
    world_size: int,
    pairs: int,
    blocks: int,
    block_steps: int,
    run_dir: str,
    d_model: int,
    bucket_mb: float,
    flight_log: bool = True,
    layers: int = 2,
    floor: bool = False,
) -> dict:
    import torch
    from prometheus_client import CollectorRegistry
    from torch.nn.parallel import DistributedDataParallel as DDP

    from meshscope.collector import DistEnv, Monitor, MonitorConfig
    from meshscope.trainer.config import ModelConfig
    from meshscope.trainer.data import SyntheticTokens
    from meshscope.trainer.model import MoELM

    cfg = ModelConfig(vocab_size=128, seq_len=32, layers=layers, d_model=d_model, heads=4, experts=8, top_k=2)
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size)
    mon = Monitor(
        MonitorConfig(run_dir=run_dir, metrics_port=None, expert_every=5, flight_log=flight_log),
        env=env,
        registry=CollectorRegistry(),
    )
    if floor:
        empty_bodies()
    cost = CostMeter()
    instrument_costs(mon, cost)
    data = SyntheticTokens(vocab_size=128, seq_len=32, batch_size=8, seed=0, rank=rank, world_size=world_size)

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

    modes = ("on", "off", "control")
    times = {m: [] for m in modes}
    block_medians = {m: [] for m in modes}  # one per (triple, block): what the interval pairs
    time.sleep(0.5)  # the responder thread's start (an import, once a run) is not a cost per step
    writer_before = thread_cpu(mon.store._thread)
    responder_thread = mon.flight._responder if mon.flight is not None else None
    responder_before = thread_cpu(responder_thread) if responder_thread is not None else 0.0
    for pair in range(pairs):
        built = [make() for _ in modes]
        order = modes[pair % 3 :] + modes[: pair % 3]  # construction order rotates
        models = dict(zip(order, built))
        mon.watch(models["on"][1])
        for i in range(3):  # warm-up all
            for m in modes:
                (step_watched if m == "on" else step_plain)(*models[m], i)
        for b in range(blocks):
            for m in modes[b % 3 :] + modes[: b % 3]:
                block = []
                for i in range(block_steps):
                    t0 = time.perf_counter()
                    (step_watched if m == "on" else step_plain)(*models[m], i)
                    block.append(time.perf_counter() - t0)
                times[m].extend(block)
                block_medians[m].append(statistics.median(block))
    writer = thread_cpu(mon.store._thread) - writer_before
    responder = thread_cpu(responder_thread) - responder_before if responder_thread is not None else 0.0
    steps_on = len(times["on"]) + 3 * pairs
    mon.close()
    parts = {"in_step": cost.seconds, "store_writer": writer, "responder": responder}
    return {
        **times,
        "blocks": block_medians,
        "cost_per_step": sum(parts.values()) / steps_on,
        "parts": {k: v / steps_on for k, v in parts.items()},
        "entries": {k: (sec / steps_on, calls / steps_on) for k, (sec, calls) in cost.by_entry.items()},
    }


def ratio_interval(results: list[dict], mode: str, draws: int = 4000) -> tuple[float, float, float]:
    """The median over blocks of `mode`'s step time over the plain model's in the same block
    (ranks averaged: they step in lockstep), with a 95 % bootstrap interval: whether the
    alternations resolve 1 %."""
    import numpy as np

    ratios = np.mean([np.divide(r["blocks"][mode], r["blocks"]["off"]) for r in results], axis=0)
    rng = np.random.default_rng(0)
    medians = np.median(rng.choice(ratios, size=(draws, ratios.size)), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(np.median(ratios)), float(low), float(high)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=3, help="fresh model triples")
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--block-steps", type=int, default=8)
    ap.add_argument(
        "--d-model",
        type=int,
        nargs="+",
        default=[64, 256],
        help="model widths to measure (64 = the demo model)",
    )
    ap.add_argument(
        "--bucket-mb",
        type=float,
        nargs="+",
        default=[25.0, 0.25],
        help="DDP bucket caps: 25 = torch's default; 0.25 = many buckets, worst case",
    )
    ap.add_argument("--layers", type=int, default=2, help="MoE layers (2 = the demo model)")
    ap.add_argument(
        "--no-flight-log", action="store_true", help="the Monitor without its flight log (a diagnosis)"
    )
    ap.add_argument(
        "--floor", action="store_true", help="the Monitor's entry points with empty bodies (a diagnosis)"
    )
    args = ap.parse_args()
    print(f"machine: {machine()}")
    print(
        f"ranks={args.ranks} triples={args.pairs} blocks={args.blocks}x{args.block_steps} "
        "steps per mode per rank"
    )
    for width, bucket_mb in itertools.product(args.d_model, args.bucket_mb):
        with tempfile.TemporaryDirectory() as d:
            results = run_ranks(
                bench,
                args.ranks,
                pairs=args.pairs,
                blocks=args.blocks,
                block_steps=args.block_steps,
                run_dir=d,
                d_model=width,
                bucket_mb=bucket_mb,
                flight_log=not args.no_flight_log,
                layers=args.layers,
                floor=args.floor,
            )
        med = {m: statistics.median(t for r in results for t in r[m]) for m in ("on", "off", "control")}
        on, control = ratio_interval(results, "on"), ratio_interval(results, "control")
        cost = results[0]["cost_per_step"]
        parts = ", ".join(f"{k} {v * 1e6:.0f}" for k, v in results[0]["parts"].items())
        print(
            f"d_model={width:4d} layers={args.layers} bucket={bucket_mb:5.2f} MB  "
            f"step on {med['on'] * 1e3:7.2f} ms  off {med['off'] * 1e3:7.2f} ms\n"
            f"    on/off {on[0]:.4f} [{on[1]:.4f}, {on[2]:.4f}]  control {control[0]:.4f} "
            f"[{control[1]:.4f}, {control[2]:.4f}]  (block medians, 95 % interval; target <= 1.01)\n"
            f"    cost {cost * 1e6:6.0f} us/step = {cost / med['off']:.2%}; account, us/step: {parts}"
        )
        entries = sorted(results[0]["entries"].items(), key=lambda kv: -kv[1][0])
        print(
            "    in step by entry, us/step (calls/step): "
            + ", ".join(f"{k} {sec * 1e6:.0f} ({calls:.1f})" for k, (sec, calls) in entries)
        )


if __name__ == "__main__":
    main()
