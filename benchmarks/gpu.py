"""Accelerator figures in one invocation, for a lent GPU (tests never need one).

    python3 benchmarks/gpu.py [--device cuda] [--quick] [--out DIR]   # default: $OUT, else runs/gpu

meshscope is one package whose rooms are folders at the repository root: on a machine where it
is not installed, install it without its dependencies first (setuptools maps the folders):
`python3 -m pip install --no-deps --no-build-isolation --target /tmp/site . && export
PYTHONPATH=/tmp/site` (with `-e .` instead of `--target` where the interpreter's site is writable).

Parts, each reported as it finishes (a failing part is reported and the rest still run):
1. host-device syncs per step, counted with `torch.cuda.set_sync_debug_mode("warn")` (every
   blocking call warns): the reference MoE training step alone, then with the Monitor;
2. Monitor overhead, world 1, the same DDP loop watched and plain in alternating blocks: dense
   transformers (d_model 1024 and 256) and the reference MoE (target <= 1.01);
3. reference MoE steps/s: the sync-free dispatch against the previous per-expert loop;
4. `meshscope run` on the device: 1 rank on its own backend (nccl), 2 ranks sharing the device
   through gloo with a nan injection (detection), and a kill -> restart with warm standby;
5. warm vs plain restart times (benchmarks/fault_recovery.py on the device, gloo);
6. wire bytes per compression hook, 2 ranks through gloo;
7. debugging on the device, 2 ranks through gloo: the tensor tracer names a poisoned module
   (forward, backward), the hang watchdog a skipped collective (abort, resume);
8. the hang scenarios on NCCL itself (benchmarks/hang_detection.py's, 2 ranks, one GPU each:
   skip, compute, op/shape/dtype/split mismatch, kill, error, and a transport stuck behind a
   kernel that never ends), with NCCL's Flight Recorder on and asked for on demand: stall ->
   verdict delay, whether it is right, and what the recorder's device states said. It needs
   2 GPUs; with one it says so and runs nothing.
`--device cpu --quick` runs the same code here as a smoke test (parts 1 and 4-6 need less of it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import REPO, machine, warm_trainer
from prometheus_client import CollectorRegistry  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from meshscope.collector import DistEnv, Monitor, MonitorConfig  # noqa: E402
from meshscope.collector.store import load_events, load_steps  # noqa: E402
from meshscope.config import load_config  # noqa: E402
from meshscope.trainer.config import ModelConfig  # noqa: E402
from meshscope.trainer.data import SyntheticTokens  # noqa: E402
from meshscope.trainer.device import Device  # noqa: E402
from meshscope.trainer.loop import train_step  # noqa: E402
from meshscope.trainer.model import MoEFeedForward, MoELM  # noqa: E402

RESULTS: dict[str, Any] = {}


def part(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run a part, print and keep its figures; a failure is a figure too."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> None:
            started = time.perf_counter()
            try:
                RESULTS[name] = fn(*args, **kwargs)
            except Exception as err:  # keep going: one device call must bring back everything
                traceback.print_exc()
                RESULTS[name] = {"error": f"{type(err).__name__}: {err}"}
            print(
                f"[{name}] {time.perf_counter() - started:.1f}s {json.dumps(RESULTS[name], default=str)}",
                flush=True,
            )

        return run

    return wrap


@contextlib.contextmanager
def counted_syncs(device: Device):
    """Count blocking host-device syncs (CUDA's sync debug mode warns on each)."""
    seen: list[int] = [0]
    if device.kind != "cuda":
        yield seen
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen
        finally:
            torch.cuda.set_sync_debug_mode("default")
    seen[0] = sum("synchroniz" in str(w.message) for w in caught)


def tiny_run_config(root: Path, **over: Any):
    return load_config(
        REPO / "configs/demo.toml",
        {"runs_root": str(root), "run_id": over.pop("run_id", "r"), "nproc": 1, "metrics_port": 9900, **over},
    )


@part("1 syncs per step")
def syncs_per_step(device: Device, steps: int) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for watched in (False, True):
            cfg = tiny_run_config(Path(tmp), run_id=f"s{watched}")
            mon, state, injector = warm_trainer(cfg, device)
            with counted_syncs(device) as seen:
                for _ in range(steps):
                    if watched:
                        train_step(state, mon, cfg, device, injector)
                    else:
                        plain_step(state, device)
            mon.close()
            out["monitor" if watched else "train step"] = seen[0] / steps
    return {"syncs/step": out, "target": "train step 0, monitor <= 0.1"}


def plain_step(state: Any, device: Device) -> None:
    from meshscope.trainer.loop import step_if_finite

    inputs, targets = map(device.upload, state.data.batch(state.step))
    loss, _ = state.model.loss(state.ddp(inputs), targets)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(state.model.parameters(), 1.0)
    step_if_finite(state.optimizer, norm)
    state.optimizer.zero_grad(set_to_none=False)
    state.step += 1


class Dense(nn.Module):
    """A plain transformer LM for the overhead comparison."""

    def __init__(self, d: int, layers: int = 4, vocab: int = 1024, seq: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, max(1, d // 64), 4 * d, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers)
        self.seq = seq

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(x)) @ self.embed.weight.T

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lm = nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        return lm, lm


@part("2 monitor overhead")
def monitor_overhead(device: Device, blocks: int, block_steps: int) -> dict:
    out = {}
    models = {
        "dense d1024": lambda: Dense(1024),
        "dense d256": lambda: Dense(256),
        "moe d256": lambda: MoELM(
            ModelConfig(vocab_size=1024, seq_len=128, layers=4, d_model=256, heads=4, experts=8, top_k=2)
        ),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in models.items():
            out[name] = overhead_pair(device, make, Path(tmp) / name.replace(" ", "_"), blocks, block_steps)
    return out


def overhead_pair(
    device: Device, make: Callable[[], nn.Module], run_dir: Path, blocks: int, block_steps: int
) -> dict:
    mon = Monitor(
        MonitorConfig(run_dir=run_dir, metrics_port=None),
        env=DistEnv(),
        probe=device.probe(),
        registry=CollectorRegistry(),
    )
    data = SyntheticTokens(vocab_size=1024, seq_len=128, batch_size=16, seed=0)
    pairs = []
    for watched in (True, False):
        torch.manual_seed(0)
        model = make().to(device.torch_device)
        ddp = DDP(model, device_ids=None if device.kind == "cpu" else [device.index])
        if watched:
            mon.watch(ddp)
        opt = torch.optim.AdamW(model.parameters(), 1e-4, fused=device.kind != "npu")
        pairs.append((model, ddp, opt))

    def one(watched: bool, i: int) -> None:
        model, ddp, opt = pairs[0 if watched else 1]
        x, y = map(device.upload, data.batch(i))
        with mon.step(tokens=x.numel()) if watched else contextlib.nullcontext() as s:
            loss, lm = model.loss(ddp(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            if s is not None:
                s.log(loss=lm)

    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(3):
        one(True, i)
        one(False, i)
    device.synchronize()
    for b in range(blocks):
        for watched in (True, False) if b % 2 == 0 else (False, True):
            start = time.perf_counter()
            for i in range(block_steps):
                one(watched, i)
            device.synchronize()  # sync point: block boundaries of the benchmark only
            times[watched].append((time.perf_counter() - start) / block_steps)
    mon.close()
    on, off = statistics.median(times[True]), statistics.median(times[False])
    return {"on_ms": round(on * 1e3, 3), "off_ms": round(off * 1e3, 3), "ratio": round(on / off, 4)}


@part("3 moe dispatch steps/s")
def moe_dispatch(device: Device, steps: int) -> dict:
    sys.path.insert(0, str(REPO))
    from fixtures.moe_reference import loop_reference

    cfg = ModelConfig(vocab_size=1024, seq_len=128, layers=4, d_model=256, heads=4, experts=8, top_k=2)
    data = SyntheticTokens(vocab_size=1024, seq_len=128, batch_size=16, seed=0)
    out = {}
    for name, forward in (
        ("per-expert loop (before)", loop_reference),
        ("static capacity (now)", MoEFeedForward.forward),
    ):
        torch.manual_seed(0)
        model = MoELM(cfg).to(device.torch_device)
        for m in model.moe_layers():
            m.forward = forward.__get__(m)
        opt = torch.optim.AdamW(model.parameters(), 1e-4)
        with counted_syncs(device) as seen:
            for i in range(steps + 3):
                if i == 3:
                    device.synchronize()
                    start = time.perf_counter()
                x, y = map(device.upload, data.batch(i))
                loss, _ = model.loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            device.synchronize()
        elapsed = time.perf_counter() - start
        out[name] = {
            "steps_per_s": round(steps / elapsed, 2),
            "syncs_per_step": round(seen[0] / (steps + 3), 2),
        }
    return out


def meshscope_run(
    root: Path, run_id: str, *args: str, timeout: int = 240, config: Path = REPO / "configs/demo.toml"
) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "meshscope",
        "run",
        "--config",
        str(config),
        "--run-dir",
        str(root),
        "--run-id",
        run_id,
        *args,
    ]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    run_dir = root / run_id
    steps = load_steps(run_dir) if (run_dir / "store.sqlite").exists() else None
    events = load_events(run_dir) if steps is not None else None
    kinds = events["kind"].value_counts().to_dict() if events is not None else {}
    anomalies = (
        [d.get("type") for d in events[events["kind"] == "anomaly"]["detail"]] if events is not None else []
    )
    result = {
        "rc": done.returncode,
        "wall_s": round(time.perf_counter() - started, 1),
        "events": kinds,
        "anomaly_types": sorted(set(anomalies)),
    }
    if steps is not None and not steps.empty:
        result.update(
            steps=int(steps["step"].max()) + 1,
            ranks=int(steps["rank"].nunique()),
            step_ms=round(float(steps["step_s"].median()) * 1e3, 2),
            bytes_wire_per_step=float(steps.groupby("step")["bytes_wire"].mean().median()),
            bytes_raw_per_step=float(steps.groupby("step")["bytes_raw"].mean().median()),
        )
    if done.returncode != 0:
        result["tail"] = (done.stdout + done.stderr)[-1500:]
    return result


@part("4 meshscope run on the device")
def runs_on_device(device: Device, steps: int) -> dict:
    kind = device.kind
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        common = ["--device", kind, "--steps", str(steps)]
        return {
            "1 rank, own backend": meshscope_run(root, "own", *common, "--nproc", "1"),
            "2 ranks, gloo, nan injected": meshscope_run(
                root,
                "gloo2",
                *common,
                "--nproc",
                "2",
                "--backend",
                "gloo",
                "--inject",
                f"nan@step={steps // 2},rank=1",
            ),
            "2 ranks, gloo, kill -> restart (warm standby)": meshscope_run(
                root,
                "kill",
                *common,
                "--nproc",
                "2",
                "--backend",
                "gloo",
                "--inject",
                f"kill@step={steps // 2},rank=1",
                "--checkpoint-every",
                "5",
                "--max-restarts",
                "1",
            ),
        }


@part("5 warm vs plain restarts")
def restarts(device: Device, kills: int) -> dict:
    cmd = [
        sys.executable,
        str(REPO / "benchmarks/fault_recovery.py"),
        "--kills",
        str(kills),
        "--every",
        "10",
        "--device",
        device.kind,
        "--backend",
        "gloo",
        "--port",
        "9950",
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400)
    return {"rc": done.returncode, "report": done.stdout.strip().splitlines()[-4:]}


@part("6 wire bytes per compression hook")
def wire_bytes(device: Device, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "no_warmup.toml"  # compress from the first step
        config.write_text(
            (REPO / "configs/demo.toml")
            .read_text()
            .replace("compression_warmup = 30", "compression_warmup = 0")
        )
        out = {}
        for hook in ("none", "fp16", "powersgd", "onebit"):
            r = meshscope_run(
                Path(tmp),
                hook,
                "--device",
                device.kind,
                "--nproc",
                "2",
                "--backend",
                "gloo",
                "--steps",
                str(steps),
                "--compression",
                hook,
                config=config,
            )
            out[hook] = {k: r.get(k) for k in ("rc", "bytes_wire_per_step", "bytes_raw_per_step", "step_ms")}
        return out


@part("7 debugging on the device: tracer and hang watchdog, 2 ranks through gloo")
def debugging(device: Device, steps: int) -> dict:
    """The tracer names a poisoned module (forward and backward) and the watchdog a skipped
    collective, on the device, as tests/meshscope/test_{trace,hang}_run.py do on the CPU."""

    def found(root: Path, run_id: str, kind: str) -> list[dict]:
        events = load_events(root / run_id)
        return [
            {k: d.get(k) for k in ("module", "where", "tensor", "type", "culprit_ranks", "op", "seq", "why")}
            | {"rank": r}
            for d, r in zip(events[events["kind"] == kind]["detail"], events[events["kind"] == kind]["rank"])
        ]

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        common = ["--device", device.kind, "--backend", "gloo", "--nproc", "2", "--steps", str(steps)]
        module = "blocks.1.moe.router.gate"
        for where in ("forward", "backward"):
            r = meshscope_run(
                root,
                where,
                *common,
                "--inject",
                f"nan@step={steps // 2},rank=1,module={module},where={where}",
            )
            out[f"tracer {where}"] = {"rc": r["rc"], "nan": found(root, where, "nan")}
        r = meshscope_run(
            root,
            "skip",
            *common,
            "--inject",
            f"skip_collective@step={steps // 2},rank=1",
            "--checkpoint-every",
            "4",
            "--max-restarts",
            "1",
            "--on-hang",
            "abort",
        )
        out["hang: skip_collective"] = {"rc": r["rc"], "hang": found(root, "skip", "hang")}
    return out


@part("8 hang scenarios on nccl")
def hangs_on_nccl(repeats: int) -> dict:
    """The watchdog's verdicts and delays with the flight log on NCCL's own semantics."""
    if torch.cuda.device_count() < 2:
        return {"ran": False, "why": f"{torch.cuda.device_count()} GPU(s): 2 ranks on nccl need 2"}
    sys.path.insert(0, str(REPO / "benchmarks"))
    from hang_detection import EXPECTED, watched

    out: dict[str, Any] = {"ran": True}
    for scenario in EXPECTED:
        out[scenario] = [
            watched(scenario, 60.0, backend="nccl", world=2, recorder=True) for _ in range(repeats)
        ]
    delays = [r["delay_s"] for runs in out.values() if isinstance(runs, list) for r in runs]
    out["median_delay_s"] = statistics.median(delays)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="fewer steps: a smoke test")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/gpu")))
    ap.add_argument("--parts", default="12345678", help="which parts to run, e.g. 124")
    args = ap.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    device = Device(args.device)
    device.activate()
    print(
        f"machine: {machine()}; device {device.kind}"
        + (f" ({torch.cuda.get_device_name()})" if device.kind == "cuda" else ""),
        flush=True,
    )
    q = args.quick
    if {"1", "2", "3"} & set(args.parts):
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29899", rank=0, world_size=1)
    if "1" in args.parts:
        syncs_per_step(device, steps=5 if q else 30)
    if "2" in args.parts:
        monitor_overhead(device, blocks=2 if q else 10, block_steps=2 if q else 20)
    if "3" in args.parts:
        moe_dispatch(device, steps=3 if q else 40)
    if "4" in args.parts:
        runs_on_device(device, steps=12 if q else 40)
    if "5" in args.parts:
        restarts(device, kills=1 if q else 3)
    if "6" in args.parts:
        wire_bytes(device, steps=8 if q else 20)
    if "7" in args.parts:
        debugging(device, steps=12 if q else 20)
    if "8" in args.parts:
        hangs_on_nccl(repeats=1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_results.json").write_text(
        json.dumps({"machine": machine(), "device": device.kind, "results": RESULTS}, indent=2, default=str)
    )


if __name__ == "__main__":
    main()
