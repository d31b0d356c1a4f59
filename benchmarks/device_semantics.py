"""What only a device shows about meshscope's device truth, in one invocation (one GPU is enough).

    python3 benchmarks/device_semantics.py [--out DIR]     # default: $OUT, else runs/device

Each check prints one line, `[name] ok | FAIL | skipped: why` with its figures, and all of them
go to <out>/device_semantics.json. Without CUDA, a check that has a twin on the simulated
accelerator runs that instead (its line says `sim`), and every other one says why it was
skipped: the script runs end to end anywhere, and on a lent GPU it checks the real thing.

1. in_flight: world 1 on NCCL, the stream held by `torch.cuda._sleep`: the all-reduce returns at
   once, the flight log says "issued" while the device is busy and "completed" after it ran.
2. coalesced: a `_coalescing_manager` block behind the same sleep: its ops stay "issued" until
   the block ran (each op's own work has no end event recorded on NCCL).
3. aborted: a collective behind the sleep, then the group aborted: what the work, its result
   future and the flight log say (NCCL completes a failed work; the log must say "failed").
4. own_device: the device-truth thread makes no context on a device the rank does not own
   (the rank on the last device; `nvidia-smi` lists the devices this process holds).
5. recorder: NCCL's Flight Recorder under meshscope's launch environment records start times.
6. sync_debug: the reference MoE step with the Monitor, and 1-bit's compression, under
   `torch.cuda.set_sync_debug_mode("error")`: the first blocking call, if any.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import REPO, machine, warm_trainer

from meshscope.collector.flightlog import FlightLog  # noqa: E402
from meshscope.collector.flightread import read_flight  # noqa: E402
from meshscope.trainer import sim  # noqa: E402
from meshscope.trainer.device import FLIGHT_RECORDER_ENV, Device  # noqa: E402

RESULTS: dict[str, Any] = {}
CUDA = torch.cuda.is_available()


class Skipped(Exception):
    """A check that cannot run on this machine, and why."""


def check(name: str) -> Callable[[Callable[..., dict]], Callable[..., None]]:
    """Run a check; print and keep its verdict and figures (a crash is a verdict too)."""

    def wrap(fn: Callable[..., dict]) -> Callable[..., None]:
        def run(*args: Any) -> None:
            try:
                found = fn(*args)
                verdict = "ok" if found.pop("ok") else "FAIL"
            except Skipped as why:
                found, verdict = {}, f"skipped: {why}"
            except Exception as err:  # noqa: BLE001  (one device call must bring back everything)
                traceback.print_exc()
                found, verdict = {"error": f"{type(err).__name__}: {err}"}, "FAIL"
            RESULTS[name] = {"verdict": verdict, "on": "cuda" if CUDA else "sim", **found}
            print(f"[{name}] {verdict} {json.dumps(found, default=str)}", flush=True)

        return run

    return wrap


def hold_stream(seconds: float) -> Callable[[], None]:
    """Keep the device's stream busy for about `seconds`; returns how to wait for it to free."""
    if CUDA:
        torch.cuda._sleep(int(seconds * 1.5e9))  # cycles: ~1.5 GHz
        return torch.cuda.synchronize
    gate = threading.Event()
    sim.stream().enqueue(gate.wait)
    return gate.set


def fresh_log(folder: Path, index: int = 0) -> FlightLog:
    """A flight log with device truth on device `index`, installed."""
    FlightLog.uninstall()
    device = Device("cuda" if CUDA else "sim", index)
    return FlightLog(folder, rank=0, world_size=1, probe=device.probe(), device_poll_s=0.01).install()


def states(log: FlightLog, op: str) -> list[str]:
    return [r.state for r in read_flight(log.path).records if r.op == op]


def settled(log: FlightLog, op: str, timeout_s: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while "issued" in (found := states(log, op)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return found


def tensor(n: int) -> torch.Tensor:
    return torch.ones(n, device="cuda" if CUDA else "cpu")


@check("1 in_flight")
def in_flight(folder: Path) -> dict:
    log = fresh_log(folder / "in_flight")
    release = hold_stream(1.0)
    started = time.perf_counter()
    work = dist.all_reduce(tensor(1024), async_op=True)
    returned_s = time.perf_counter() - started
    time.sleep(0.3)  # many rounds of the device thread's queries
    during = states(log, "all_reduce")
    release()
    work.wait()
    after = settled(log, "all_reduce")
    ok = during == ["issued"] and after == ["completed"] and returned_s < 0.2
    return {"ok": ok, "returned_s": round(returned_s, 4), "while busy": during, "after": after}


@check("2 coalesced")
def coalesced(folder: Path) -> dict:
    log = fresh_log(folder / "coalesced")
    group = dist.distributed_c10d._get_default_group()
    device = torch.device("cuda", 0) if CUDA else torch.device("cpu")
    release = hold_stream(1.0)
    with dist._coalescing_manager(group, device=device, async_ops=True) as block:
        dist.all_reduce(tensor(256))
        dist.all_reduce(tensor(512))
    time.sleep(0.3)
    during = states(log, "all_reduce")
    release()
    block.wait()
    after = settled(log, "all_reduce")
    return {
        "ok": during == ["issued"] * 2 and after == ["completed"] * 2,
        "while busy": during,
        "after": after,
    }


@check("3 aborted")
def aborted(folder: Path) -> dict:
    if not CUDA:
        raise Skipped("needs NCCL (the sim's failed collective is tests/trainer/test_sim.py, 2 ranks)")
    log = fresh_log(folder / "aborted")
    hold_stream(2.0)
    work = dist.all_reduce(tensor(1024), async_op=True)
    dist.distributed_c10d._get_default_group().abort()
    deadline = time.monotonic() + 30
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.05)
    result = work.get_future_result()
    code = int(result.value()) if result.done() else None
    logged = settled(log, "all_reduce")
    return {"ok": logged == ["failed"], "completed": work.is_completed(), "result": code, "logged": logged}


@check("4 own_device")
def own_device(folder: Path) -> dict:
    if not CUDA:  # the rank on sim device 3: no thread of its may touch device 0
        sim.SIM.set_device(3)
        sim.forget_contexts()
        log = fresh_log(folder / "own_device", index=3)
        dist.all_reduce(tensor(8), async_op=True)
        log.step_end(Device("sim", 3).probe().mark())
        time.sleep(0.2)
        log.close()
        return {"ok": sim.contexts() == {3}, "contexts": sorted(sim.contexts())}
    if torch.cuda.device_count() < 2:
        raise Skipped("needs 2 GPUs to show a context on a device the rank does not own")
    last = torch.cuda.device_count() - 1
    code = (
        "import torch, time; from meshscope.collector.flightlog import FlightLog; "
        "from meshscope.trainer.device import Device; import tempfile; "
        f"torch.cuda.set_device({last}); d = Device('cuda', {last}); "
        "log = FlightLog(tempfile.mkdtemp(), rank=0, world_size=1, probe=d.probe()); "
        "[log.step_end(d.probe().mark()) for _ in range(3)]; time.sleep(1); "
        "import subprocess, os; print(subprocess.run(['nvidia-smi', '--query-compute-apps=pid,gpu_uuid', "
        "'--format=csv,noheader'], capture_output=True, text=True).stdout)"
    )
    out = subprocess.run(["python3", "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    return {"ok": out.returncode == 0, "nvidia-smi": out.stdout.strip(), "stderr": out.stderr[-500:]}


@check("5 recorder")
def recorder(folder: Path) -> dict:
    if not CUDA:
        raise Skipped("needs NCCL's Flight Recorder")
    import pickle

    for _ in range(3):
        dist.all_reduce(tensor(64))
    torch.cuda.synchronize()
    dump = pickle.loads(torch._C._distributed_c10d._dump_nccl_trace())
    entries = dump.get("entries", [])
    started = [e for e in entries if e.get("time_discovered_started_ns")]
    return {
        "ok": bool(entries) and len(started) == len(entries),
        "entries": len(entries),
        "started": len(started),
    }


@check("6 sync_debug")
def sync_debug(folder: Path) -> dict:
    if not CUDA:
        raise Skipped("needs CUDA's sync debug mode (on the sim: tests/meshscope/test_sync_audit.py)")
    from meshscope.config import load_config
    from meshscope.trainer.loop import train_step
    from meshscope.trainer.onebit import compress, decompress

    device = Device("cuda", 0)
    cfg = load_config(REPO / "configs/demo.toml", {"runs_root": str(folder), "run_id": "s", "nproc": 1})
    mon, state, injector = warm_trainer(cfg, device)
    found = {}
    for name, step in {
        "moe step + monitor": lambda: train_step(state, mon, cfg, device, injector),
        "1-bit compress": lambda: decompress(*compress(torch.randn(4096, device="cuda"), 256)[:2]),
    }.items():
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(10):
                step()
            found[name] = "no sync"
        except RuntimeError as err:
            found[name] = str(err).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    mon.close()
    return {"ok": set(found.values()) == {"no sync"}, **found}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/device")))
    args = ap.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if CUDA:
        for key, value in FLIGHT_RECORDER_ENV.items():  # as meshscope's launcher sets them
            os.environ.setdefault(key, value)
        torch.cuda.set_device(0)
        backend = "nccl"
    else:
        sim.register_backends()
        backend = "simnccl"
    print(f"machine: {machine()}; {'CUDA ' + torch.cuda.get_device_name() if CUDA else 'no CUDA: the sim'}")
    dist.init_process_group(backend, init_method="tcp://127.0.0.1:29897", rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for run in (in_flight, coalesced, own_device, recorder, sync_debug, aborted):  # abort last
            run(folder)
    FlightLog.uninstall()
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(), "cuda": CUDA, "results": RESULTS}
    (args.out / "device_semantics.json").write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
