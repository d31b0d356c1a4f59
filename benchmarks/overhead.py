"""Monitor overhead: one DDP MoE loop with the Monitor switched on and off, alternating in blocks.

One model is built and stepped in blocks of three kinds, the order rotating block by block:
watched by the Monitor (phase marks, the wait after backward, expert counts, records to the
store and /metrics families), plain (DDP's built-in C++ all-reduce, no hook), and plain again.
Between blocks the Monitor's forward hook is removed or put back and DDP's timing rate set
(`Switch`): the watched and the plain steps run the same tensors, so the ratio holds no
difference of memory layout (two identical models differ by a few percent through it alone).
Several fresh models are built in turn. A block lasts at least `--block-s` (by default the
Monitor's `record_every_s`): its service thread makes records a batch at a time, and blocks
shorter than that would hold a batch round in one block of several, which a median leaves out.

Printed per configuration:
- `on/plain`: a watched block's mean step time over the mean of the two plain blocks in the
  same rotation, the median over blocks, with a 95 % bootstrap interval over blocks (target
  <= 1.01; the interval says whether this many alternations resolve 1 %). Both plain blocks
  run the same plain code, so their mean halves the baseline's share of the noise (the
  interval narrows by about a quarter); `on/off`, over the first plain block alone, is how
  earlier runs read it. The mean step, so the one step in ten that writes the window's
  records counts;
- `cpu on/plain`: the same for the process's CPU time a step (every thread of a rank). Waiting
  and the hypervisor's steal are out of it, so it resolves finer; what the Monitor costs
  beyond its own entry points (caches it evicts, threads it wakes) is in it. The Monitor's
  threads (its service thread, the store writer, the responder, DDP's figure) record a
  watched block's steps up to `record_every_s` later, partly while the next, plain, block
  runs: what they spend in any block is moved onto the latest watched block, so a plain block
  never carries the Monitor's work and the ratio is not flattered by it;
- `cpu on-plain`: where the CPU difference sits, µs a step with 95 % intervals: the training
  thread's own clock, and the threads that are neither it nor the Monitor's (gloo's,
  autograd's), which no account meters;
- `control`: the second plain block over the first, likewise: the same code, so this is the
  noise floor of this machine, measured in the same invocation;
- `cost`: CPU time the Monitor itself spent per step on rank 0 (its context managers, hooks,
  autograd callbacks, its service thread, its store-writer thread and the flight log's
  responder thread), and that cost over the plain step time: an account, entry by entry, of
  where the overhead sits. It is read in watched steps of their own after the timed blocks
  (`--account-steps`): metering costs ~1 % of a small step, which the ratios must not carry,
  and the threads beside training are read over those same steps.

    .venv/bin/python benchmarks/overhead.py [--ranks 2 --models 3 --blocks 40 --block-steps 8 --block-s 1
        --layers 2]
        [--set KNOB=VALUE: a Monitor setting, e.g. memory_every=10, for what it costs]
        [--dump PATH: every block's figures, as JSON]
    .venv/bin/python benchmarks/overhead.py --pool A.json B.json   (dumps of one command, as one run)
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

from _common import machine, run_ranks

from meshscope.collector.monitor import _fast
from meshscope.collector.scope import Untimed


class CostMeter:
    """Thread CPU time spent inside wrapped callables (the Monitor's entry points)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.by_entry: dict[str, list[float]] = {}  # name -> [seconds, calls]: where it goes
        self.self_metered: set[str] = set()  # entries metered in C (`add_metered`)

    def add(self, name: str, seconds: float) -> None:
        self.seconds += seconds
        spent = self.by_entry.setdefault(name, [0.0, 0])
        spent[0] += seconds
        spent[1] += 1

    def add_metered(self, name: str, seconds: float, calls: int) -> None:
        """An entry metered where it runs (in C): no meter of ours around it to take off."""
        self.seconds += seconds
        self.by_entry[name] = [seconds, calls]
        self.self_metered.add(name)

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
                # a phase of an untimed step is a C no-op (`collector.scope`): what the meter
                # says its exit cost is the meter's own cost (`meter_bias`)
                self.name = METER_PROBE if type(self.inner) in UNTIMED_PHASES else name
                if _fast is not None and type(self.inner) is _fast.Steps:  # timed or not, in C
                    self.name += " (C, timed)" if self.inner.detailed else " (C)"
                meter.add(f"{self.name} enter", time.thread_time() - start)
                if _fast is not None and type(self.value) is _fast.Steps:  # an untimed step in C
                    self.value = MeteredScope(self.value, meter)

            def __enter__(self):
                return self.value

            def __exit__(self, *exc):
                start = time.thread_time()
                try:
                    return self.inner.__exit__(*exc)
                finally:
                    meter.add(f"{self.name} exit", time.thread_time() - start)

        def enter(*args, **kwargs):  # a function, so it binds as a method too
            return Timed(*args, **kwargs)

        return enter


class MeteredScope:
    """The scope of an untimed step C runs (`collector/csrc/`), its `phase` and `log`
    metered as the Python scope's are."""

    def __init__(self, scope, meter: CostMeter) -> None:
        self.phase = meter.wrap_context(scope.phase)
        self.log = meter.wrap(scope.log)


METER_PROBE = "StepScope.phase (untimed)"
C_METER_PROBE = "C meter (empty)"  # C's meter around nothing, after the forward's watch (`_fast.metered`)
# the contexts of an untimed step's phases: Python's, and C's
UNTIMED_PHASES = (type(Untimed()),) + ((_fast.NoOp,) if _fast is not None else ())


def meter_bias(entries: dict[str, tuple[float, float]]) -> float:
    """Seconds the meter itself adds to one metered call, read where the call does nothing (an
    untimed phase's exit, a C no-op) right after a phase's compute, as the entries it meters
    run: the account less this times its calls is what the entries cost without the meter."""
    seconds, calls = entries.get(f"{METER_PROBE} exit", (0.0, 0.0))
    return seconds / calls if calls else 0.0


def instrument_costs(mon, cost: CostMeter) -> None:
    """Route the Monitor's entry points through the cost meter (this process only)."""
    from meshscope.collector import comm, expert_counts, flightlog, monitor

    mon.step = cost.wrap_context(mon.step)
    monitor.StepScope.phase = cost.wrap_context(monitor.StepScope.phase)
    monitor.StepScope.log = cost.wrap(monitor.StepScope.log)
    # expert counts: their own forward hook on a plain model, inside the backward watch's on DDP
    expert_counts.ExpertCounts._on_forward = cost.wrap(expert_counts.ExpertCounts._on_forward)
    # the backward watch, with the flight log's one record of DDP's reduction a step
    # (`forward_ended` is `_on_forward`'s tail: C calls it only where it leaves a step to Python)
    for name in ("_on_forward", "_on_backward_start", "_on_local_backward", "_on_graph_done", "_on_reduced"):
        setattr(comm.BackwardWatch, name, cost.wrap(getattr(comm.BackwardWatch, name)))
    # the per-bucket path, where a Python comm hook runs: its record and completion callbacks
    flightlog._bucket_done = cost.wrap(flightlog._bucket_done)
    real_instrument = comm.instrument_hook
    monitor.instrument_hook = lambda *a, **k: cost.wrap(real_instrument(*a, **k))


def empty_bodies() -> None:
    """`--floor`: the Monitor's entry points keep their hooks, contexts and callbacks, and
    time phases on the steps the Monitor would (`detail_every`), but do no work in them (no
    record, no flight log, no expert counts): what entering the Monitor costs on this host,
    whatever an entry does. A diagnosis, not a Monitor."""
    import torch

    from meshscope.collector import comm, expert_counts, monitor
    from meshscope.collector.scope import StepScope

    queue = torch.autograd.Variable._execution_engine.queue_callback

    def begin(self, tokens, step):
        self._step += 1
        detailed = self._step % self._detail_every == 0  # phases timed one step in N, as the Monitor's
        if self._backward is not None:
            self._state.timing = detailed
        return StepScope(self.probe, detailed), time.time(), time.perf_counter()

    def _on_forward(self, module, args, output):  # the backward's hook on timed steps only
        if self.state.timing and torch.is_grad_enabled() and (node := comm._grad_node(output)) is not None:
            node.register_prehook(self._on_backward_start)

    monitor.Monitor._begin = begin
    monitor.Monitor._end = lambda self, scope, tokens, wall, start: None
    expert_counts.ExpertCounts.forward_done = lambda self, start=0: None
    comm.BackwardWatch._on_forward = _on_forward
    comm.BackwardWatch._on_backward_start = lambda self, grads: queue(self._on_graph_done)
    comm.BackwardWatch._on_graph_done = lambda self: queue(self._on_reduced)
    comm.BackwardWatch._on_reduced = lambda self: None


PAIRS = (("on", "plain"), ("control", "off"))  # what each printed ratio reads against (module doc)
DDP_SAMPLE_RATE = 100  # DDP's own rate of timed iterations (kDDPRuntimeLoggingSampleRate)


class Switch:
    """The Monitor on one DDP model, switched on and off between blocks: the watched and the
    plain steps run the same model, so the ratio holds no difference of memory layout (two
    identical models differ by a few percent through it alone)."""

    def __init__(self, mon, ddp) -> None:
        self.mon, self.ddp = mon, ddp
        self.on = False

    def turn(self, on: bool) -> None:
        """Watched (on) or plain (off) from the next step."""
        if on == self.on:
            return
        self.on = on
        if on and self.mon._backward is None:
            self.mon.watch(self.ddp)
        elif on:  # the watch's wrapper again, around the class's methods as they are now
            self.mon._backward.attach(self.ddp)
            self._rate(self.mon._comm_every)
        else:
            self.ddp.__dict__.pop("forward", None)  # the watch's wrapper (`comm.after_forward`)
            self._rate(DDP_SAMPLE_RATE)

    def _rate(self, every: int) -> None:
        if not self.mon.probe.asynchronous:  # on a device the Monitor leaves DDP's rate alone
            self.ddp._set_ddp_runtime_logging_sample_rate(every)


def thread_cpu(thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def monitor_threads(mon) -> dict:
    """The Monitor's threads beside training, by what they do (None: not running here)."""
    return {
        "monitor_service": mon._service._thread,  # the Monitor's drain: records, gauges, rows
        "store_writer": mon.store._thread,
        "responder": mon.flight._responder._thread if mon.flight is not None else None,
        "ddp_stats": mon._ddp_stats._thread if mon._ddp_stats is not None else None,  # DDP's figure
    }


def threads_cpu(threads: dict) -> float:
    """CPU seconds the running ones of `threads` have spent."""
    return sum(thread_cpu(t) for t in threads.values() if t is not None)


def bench(
    rank: int,
    world_size: int,
    models: int,
    blocks: int,
    block_steps: int,
    run_dir: str,
    d_model: int,
    bucket_mb: float,
    flight_log: bool = True,
    layers: int = 2,
    floor: bool = False,
    account_steps: int = 200,
    settings: dict | None = None,
    python_only: bool = False,
    block_s: float = 0.0,
) -> dict:
    import torch
    from prometheus_client import CollectorRegistry
    from torch.nn.parallel import DistributedDataParallel as DDP

    from meshscope.collector import DistEnv, Monitor, MonitorConfig
    from meshscope.trainer.config import ModelConfig
    from meshscope.trainer.data import SyntheticTokens
    from meshscope.trainer.model import MoELM

    if python_only:  # the Monitor's Python path only, as where no C compiler built `_fast`
        from meshscope.collector import comm, flightlog, monitor, scope

        for module in (comm, flightlog, monitor, scope):
            module._fast = None
    cfg = ModelConfig(vocab_size=128, seq_len=32, layers=layers, d_model=d_model, heads=4, experts=8, top_k=2)
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size)
    mon = Monitor(
        MonitorConfig(
            **{"expert_every": 5, "flight_log": flight_log, **(settings or {})},
            run_dir=run_dir,
            metrics_port=None,
        ),
        env=env,
        registry=CollectorRegistry(),
    )
    if floor:
        empty_bodies()
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
    # one per (model, block): what the interval pairs. The mean step, not the median: the
    # Monitor's window (every 10th step writes the records) is one step in ten, which a
    # median leaves out.
    block_means = {m: [] for m in modes}
    block_cpu = {m: [] for m in modes}  # the process's CPU time a step, every thread, per block
    # where a block's CPU went: the training thread, and the threads neither it nor the
    # Monitor's (gloo's, autograd's): what the account cannot meter
    block_train = {m: [] for m in modes}
    block_other = {m: [] for m in modes}
    time.sleep(0.5)  # the responder thread's start (an import, once a run) is not a cost per step
    plain_s = 0.0
    owed_to = None  # the watched block the Monitor's threads are working for
    for _ in range(models):
        model, ddp, opt = make()
        watched = Switch(mon, ddp)
        for i in range(3):  # warm-up both ways
            for m in modes:
                watched.turn(m == "on")
                t0 = time.perf_counter()
                (step_watched if m == "on" else step_plain)(model, ddp, opt, i)
                if m == "off":
                    plain_s = time.perf_counter() - t0
        if block_s:  # once: blocks that hold the Monitor's batch rounds in their share
            block_steps, block_s = _steps_for(block_s, plain_s, block_steps), 0.0
        for b in range(blocks):
            for m in modes[b % 3 :] + modes[: b % 3]:
                watched.turn(m == "on")
                block = []
                cpu, train = time.process_time(), time.thread_time()
                beside = threads_cpu(monitor_threads(mon))
                for i in range(block_steps):
                    t0 = time.perf_counter()
                    (step_watched if m == "on" else step_plain)(model, ddp, opt, i)
                    block.append(time.perf_counter() - t0)
                times[m].extend(block)
                block_means[m].append(statistics.fmean(block))
                # the Monitor's threads' CPU in this block is the latest watched block's
                # (module doc); the rest of the process's is this block's own
                spent = threads_cpu(monitor_threads(mon)) - beside
                train = time.thread_time() - train
                block_cpu[m].append((time.process_time() - cpu - spent) / block_steps)
                block_train[m].append(train / block_steps)
                block_other[m].append(block_cpu[m][-1] - train / block_steps)
                if m == "on":
                    owed_to = len(block_cpu["on"]) - 1
                if owed_to is not None:
                    block_cpu["on"][owed_to] += spent / block_steps
    # The account is metered after the timed blocks, in steps of its own: the meter's two
    # thread-clock reads and a wrapper an entry cost ~1 % of a 16 ms step, which the ratio
    # must not carry. The threads beside training are read over the same watched steps.
    threads = monitor_threads(mon)
    mon.flush()  # the blocks' steps recorded and committed here, not in the account's rounds
    before = {k: thread_cpu(t) for k, t in threads.items() if t is not None}
    cost = CostMeter()
    instrument_costs(mon, cost)
    watched.turn(False)
    watched.turn(True)  # its forward watched again, through the meter
    if _fast is not None:  # C meters the forward watch's body it runs (no Python entry to wrap)
        _fast.meter(True)
    for i in range(account_steps):
        step_watched(model, ddp, opt, i)
    c_bias = 0.0  # what C's meter adds to one call it meters (`C_METER_PROBE`)
    if _fast is not None:
        for name, (seconds, calls) in _fast.metered().items():
            if name == C_METER_PROBE:
                c_bias = seconds / calls if calls else 0.0
            elif calls:
                cost.add_metered(name, seconds, calls)
        _fast.meter(False)
    # the account's last batch (records every `record_every_s`) and its commit by the writer
    time.sleep(mon.config.record_every_s + 2 * mon.config.drain_interval_s + mon.store.flush_interval_s)
    beside = {k: (thread_cpu(threads[k]) - cpu) / account_steps for k, cpu in before.items()}
    mon.close()
    parts = {"in_step": cost.seconds / account_steps, **{k: beside.get(k, 0.0) for k in threads}}
    return {
        **times,
        "blocks": block_means,
        "cpu": block_cpu,
        "train": block_train,
        "other": block_other,
        "cost_per_step": sum(parts.values()),
        "parts": parts,
        "entries": {k: (sec / account_steps, n / account_steps) for k, (sec, n) in cost.by_entry.items()},
        "self_metered": sorted(cost.self_metered),
        "c_meter_bias": c_bias,
        "block_steps": block_steps,
    }


def _steps_for(block_s: float, step_s: float, least: int) -> int:
    """Steps a block of `block_s` seconds takes (at least `least`), the same on every rank."""
    import torch
    import torch.distributed as dist

    steps = torch.tensor([max(least, math.ceil(block_s / step_s))])
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    return int(steps)


def ratio_interval(
    results: list[dict], mode: str, draws: int = 4000, figure: str = "blocks", over: str = "plain"
) -> tuple[float, float, float]:
    """The median over blocks of `mode`'s figure over `over`'s in the same rotation (`blocks`:
    the mean step time; `cpu`: the CPU time a step; ranks averaged, they step in lockstep),
    with a 95 % bootstrap interval: whether the alternations resolve 1 %. `over="plain"`: the
    mean of the rotation's two plain blocks (module doc)."""
    import numpy as np

    ratios = np.mean([np.divide(r[figure][mode], _baseline(r[figure], over)) for r in results], axis=0)
    rng = np.random.default_rng(0)
    medians = np.median(rng.choice(ratios, size=(draws, ratios.size)), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(np.median(ratios)), float(low), float(high)


def difference_interval(results: list[dict], figure: str, draws: int = 4000) -> tuple[float, float, float]:
    """The median over blocks of a watched block's `figure` less the mean of the two plain
    blocks' in the same rotation (seconds a step, ranks averaged), with a 95 % bootstrap
    interval."""
    import numpy as np

    diffs = np.mean([np.subtract(r[figure]["on"], _baseline(r[figure], "plain")) for r in results], axis=0)
    rng = np.random.default_rng(0)
    medians = np.median(rng.choice(diffs, size=(draws, diffs.size)), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(np.median(diffs)), float(low), float(high)


def _baseline(blocks: dict, over: str):
    """Per rotation, what a figure is read against: one block's (`off`), or the mean of the two
    plain blocks (`plain`)."""
    import numpy as np

    if over == "plain":
        return (np.asarray(blocks["off"]) + np.asarray(blocks["control"])) / 2
    return np.asarray(blocks[over])


def _settings(ap: argparse.ArgumentParser, pairs: list[str]) -> dict:
    """`--set` pairs as Monitor settings, refused by name before anything starts."""
    from pydantic import ValidationError

    from meshscope.collector.monitor_config import MonitorSettings

    out = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            ap.error(f"--set {pair!r}: give KNOB=VALUE")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    try:
        MonitorSettings(**out)
    except ValidationError as err:
        ap.error(f"--set: {err.errors()[0]['loc'][0]}: {err.errors()[0]['msg']}")
    return out


def record_every(settings: dict) -> float:
    """The Monitor's batch interval under `settings` (its default where not set)."""
    from meshscope.collector.monitor_config import MonitorSettings

    return MonitorSettings(**settings).record_every_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--models", type=int, default=3, help="fresh models, each switched on and off")
    ap.add_argument("--blocks", type=int, default=40, help="block rotations per model")
    ap.add_argument("--block-steps", type=int, default=8, help="steps a block, at least")
    ap.add_argument(
        "--block-s",
        type=float,
        default=None,
        help="seconds a block, at least (default: the Monitor's record_every_s, so that every "
        "block holds its batch rounds in their share; a median over shorter blocks leaves them out)",
    )
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
    ap.add_argument(
        "--account-steps", type=int, default=200, help="watched steps metered one entry at a time, after"
    )
    ap.add_argument(
        "--python-only",
        action="store_true",
        help="the Monitor without its C path (`collector/csrc/`), as where no compiler built it",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="a Monitor setting (`meshscope config`: monitor.*), e.g. memory_every=10: what it costs",
    )
    ap.add_argument(
        "--dump", metavar="PATH", help="write each rank's per-block figures as JSON (d_model -> ranks)"
    )
    ap.add_argument(
        "--pool",
        nargs="+",
        metavar="PATH",
        help="run nothing: read these --dump files of one command, run back to back, as one run "
        "(more rotations, a narrower interval) and print its ratios",
    )
    args = ap.parse_args()
    if args.pool:
        return pool(ap, args.pool)
    if args.account_steps < 1:
        ap.error("--account-steps must be at least 1")
    settings = _settings(ap, args.set)
    path = "  Python path only" if args.python_only or _fast is None else ""
    print(f"machine: {machine()}" + (f"  settings: {settings}" if settings else "") + path)
    print(
        f"ranks={args.ranks} models={args.models} blocks={args.blocks} of at least {args.block_steps} "
        "steps per mode per rank"
    )
    dumped: dict[str, list[dict]] = {}
    for width, bucket_mb in itertools.product(args.d_model, args.bucket_mb):
        with tempfile.TemporaryDirectory() as d:
            results = run_ranks(
                bench,
                args.ranks,
                models=args.models,
                blocks=args.blocks,
                block_steps=args.block_steps,
                run_dir=d,
                d_model=width,
                bucket_mb=bucket_mb,
                flight_log=not args.no_flight_log,
                layers=args.layers,
                floor=args.floor,
                account_steps=args.account_steps,
                settings=settings,
                python_only=args.python_only,
                block_s=args.block_s if args.block_s is not None else record_every(settings),
            )
        if args.dump:
            figures = ("blocks", "cpu", "train", "other")
            dumped[f"{width}/{bucket_mb}"] = [{k: r[k] for k in figures} for r in results]
            Path(args.dump).write_text(json.dumps(dumped))
        med = {m: statistics.median(t for r in results for t in r[m]) for m in ("on", "off", "control")}
        parts = ", ".join(f"{k} {v * 1e6:.0f}" for k, v in results[0]["parts"].items())
        print(
            f"d_model={width:4d} layers={args.layers} bucket={bucket_mb:5.2f} MB  "
            f"step on {med['on'] * 1e3:7.2f} ms  off {med['off'] * 1e3:7.2f} ms  "
            f"blocks of {results[0]['block_steps']} steps\n{ratio_lines(results)}\n"
            f"    account, us/step (metered): {parts}"
        )
        entries = sorted(results[0]["entries"].items(), key=lambda kv: -kv[1][0])
        print(
            "    in step by entry, us/step (calls/step): "
            + ", ".join(f"{k} {sec * 1e6:.0f} ({calls:.1f})" for k, (sec, calls) in entries)
        )
        net = training_thread(results[0])
        if net is None:  # every step timed (`--set detail_every=1`): no no-op to read the meter on
            print("    training thread less the meter: unknown (no untimed phase to read the meter on)")
            continue
        beside = sum(v for k, v in results[0]["parts"].items() if k != "in_step")
        print(
            f"    training thread less the meter: {net * 1e6:.0f} us/step (budget 30 us)\n"
            f"    cost {(net + beside) * 1e6:6.0f} us/step = {(net + beside) / med['off']:.2%} of the plain "
            "step: the training thread less the meter and the threads beside it"
        )


def ratio_lines(results: list[dict]) -> str:
    """The ratios and differences of a run's blocks, as printed (module doc)."""
    (on, control), (cpu_on, cpu_control) = (
        [ratio_interval(results, m, figure=f, over=o) for m, o in PAIRS] for f in ("blocks", "cpu")
    )
    on_off, cpu_on_off = (ratio_interval(results, "on", figure=f, over="off") for f in ("blocks", "cpu"))
    return (
        f"    on/plain {_ratio(on)}  control {_ratio(control)}  (block means, 95 % interval; "
        f"target <= 1.01)  on/off {_ratio(on_off)}\n"
        f"    cpu on/plain {_ratio(cpu_on)}  control {_ratio(cpu_control)}  "
        f"(CPU time a step, every thread of a rank)  cpu on/off {_ratio(cpu_on_off)}\n"
        f"    cpu on-plain, us/step: training thread {_us(difference_interval(results, 'train'))}, "
        f"other threads (gloo's, autograd's) {_us(difference_interval(results, 'other'))}"
    )


def pool(ap: argparse.ArgumentParser, paths: list[str]) -> None:
    """`--pool`: several `--dump` files of one command read as one run, rank by rank: each
    rank's blocks of every file, in order (a rotation's blocks stay together). A file that is
    no dump, or lacks a configuration of the first, is refused (exit 2) before any is read."""
    try:
        dumps = [json.loads(Path(p).read_text()) for p in paths]
    except (OSError, ValueError) as err:
        ap.error(f"--pool: {err}")
    if not all(isinstance(d, dict) and d for d in dumps):
        ap.error(f"--pool: not every file of {paths} is a --dump of overhead.py")
    for key in dumps[0]:
        missing = [p for p, d in zip(paths, dumps) if len(d.get(key, ())) != len(dumps[0][key])]
        if missing:
            ap.error(f"--pool: {key} (d_model/bucket MB) is not in {missing} as in {paths[0]}")
    print(f"pooled: {', '.join(paths)}")
    for key in dumps[0]:
        pooled = [
            {f: {m: [x for r in ranks for x in r[f][m]] for m in ranks[0][f]} for f in ranks[0]}
            for ranks in zip(*(d[key] for d in dumps))
        ]
        print(f"d_model/bucket MB {key}: {len(pooled[0]['cpu']['on'])} rotations\n{ratio_lines(pooled)}")


def _ratio(figure: tuple[float, float, float]) -> str:
    return f"{figure[0]:.4f} [{figure[1]:.4f}, {figure[2]:.4f}]"


def _us(figure: tuple[float, float, float]) -> str:
    return f"{figure[0] * 1e6:.0f} [{figure[1] * 1e6:.0f}, {figure[2] * 1e6:.0f}]"


def training_thread(result: dict) -> float | None:
    """The training thread's metered seconds a step less what the meters themselves cost
    (Python's read on an untimed phase's no-op exit, C's on its probe); None where no step
    was untimed."""
    entries, in_c = result["entries"], set(result["self_metered"])
    bias, calls = meter_bias(entries), sum(n for k, (_, n) in entries.items() if k not in in_c)
    if not bias:
        return None
    c_calls = sum(n for k, (_, n) in entries.items() if k in in_c)
    return result["parts"]["in_step"] - bias * calls - result["c_meter_bias"] * c_calls


if __name__ == "__main__":
    main()
