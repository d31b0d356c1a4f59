"""Hang scenarios on real gloo ranks, with each rank's flight log where the watchdog reads it.

Every rank all-reduces once per step; the culprit (the last rank) misbehaves at `FAULT_STEP`
as the scenario says. After the loop the ranks meet in a barrier on a side group, as
meshscope's control plane does at the end of a run.
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from meshscope.collector.flightlog import FlightLog
from meshscope.trainer.inject import wrong_splits

FAULT_STEP = 3
STEPS = 8


def _normal(rank: int, step: int, culprit: int) -> None:
    dist.all_reduce(torch.ones(64))


def _skip(rank: int, step: int, culprit: int) -> None:
    if not (rank == culprit and step == FAULT_STEP):
        dist.all_reduce(torch.ones(64))


def _compute(rank: int, step: int, culprit: int) -> None:
    if rank == culprit and step == FAULT_STEP:
        time.sleep(120)
    dist.all_reduce(torch.ones(64))


def _op(rank: int, step: int, culprit: int) -> None:
    if rank == culprit and step == FAULT_STEP:
        dist.broadcast(torch.ones(64), src=culprit)
    else:
        dist.all_reduce(torch.ones(64))


def _shape(rank: int, step: int, culprit: int) -> None:
    dist.all_reduce(torch.ones(65 if rank == culprit and step == FAULT_STEP else 64))


def _dtype(rank: int, step: int, culprit: int) -> None:
    wrong = rank == culprit and step == FAULT_STEP
    dist.all_reduce(torch.ones(64, dtype=torch.float64 if wrong else torch.float32))


def _split(rank: int, step: int, culprit: int) -> None:
    world = dist.get_world_size()
    send = wrong_splits(rank, world) if rank == culprit and step == FAULT_STEP else [2] * world
    out = torch.zeros(2 * world)
    dist.all_to_all_single(out, torch.ones(sum(send)), output_split_sizes=[2] * world, input_split_sizes=send)


def _kill(rank: int, step: int, culprit: int) -> None:
    if rank == culprit and step == FAULT_STEP:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(64))


def _error(rank: int, step: int, culprit: int) -> None:
    if rank == culprit and step == FAULT_STEP:
        raise ValueError("a bug in the culprit's data pipeline")
    dist.all_reduce(torch.ones(64))


SCENARIOS = {
    "skip": _skip,
    "compute": _compute,
    "op": _op,
    "shape": _shape,
    "dtype": _dtype,
    "split": _split,
    "kill": _kill,
    "error": _error,
    "clean": _normal,
}


def rank_main(
    rank: int,
    world: int,
    port: int,
    live_dir: str,
    scenario: str,
    timeout_s: float = 90.0,
    flight: bool = True,
) -> None:
    """One rank of a scenario (a spawn target). Without `flight`, the plain job: only the
    process group's own timeout and errors; `<live>/exit-rank<R>.json` says when and how each
    rank ended."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    if not flight:
        _plain(rank, world, Path(live_dir), scenario)
        return
    side = dist.new_group(backend="gloo")
    log = FlightLog(Path(live_dir), rank=rank, world_size=world).install()
    log.start_responder(poll_s=0.05)
    try:
        for step in range(STEPS):
            log.step_begin(step)
            SCENARIOS[scenario](rank, step, world - 1)
            log.step_end()
            time.sleep(0.02)
        dist.barrier(group=side)
    except Exception as err:
        log.note_error(err)
        raise
    finally:
        log.close()


def _plain(rank: int, world: int, live_dir: Path, scenario: str) -> None:
    live_dir.mkdir(parents=True, exist_ok=True)
    side = dist.new_group(backend="gloo")
    outcome = {"rank": rank, "error": ""}
    try:
        for step in range(STEPS):
            if rank == world - 1 and step == FAULT_STEP:
                (live_dir / "fault_time").write_text(str(time.time()))
            SCENARIOS[scenario](rank, step, world - 1)
            time.sleep(0.02)
        dist.barrier(group=side)
    except Exception as err:
        outcome["error"] = str(err)[:300]
        raise
    finally:
        outcome["time"] = time.time()
        (live_dir / f"exit-rank{rank}.json").write_text(json.dumps(outcome))


def fr_rank_main(rank: int, world: int, port: int, out_dir: str, scenario: str) -> None:
    """A job without meshscope, with PyTorch's Flight Recorder on: three good steps, then the
    scenario's collective (the culprit skips it, or calls another op) left in flight, then
    every rank dumps its recorder to `<out_dir>/rank<R>` and leaves."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    for _ in range(FAULT_STEP):
        dist.all_reduce(torch.ones(64))
    culprit = rank == world - 1
    if scenario == "missing" and not culprit:
        dist.all_reduce(torch.ones(64), async_op=True)
    elif scenario == "all_to_all" and not culprit:
        dist.all_to_all_single(torch.zeros(2 * world), torch.ones(2 * world), async_op=True)
    elif scenario == "op":
        if culprit:
            dist.broadcast(torch.ones(64), src=rank, async_op=True)
        else:
            dist.all_reduce(torch.ones(64), async_op=True)
    time.sleep(1.0)
    dump = torch._C._distributed_c10d._dump_fr_trace(
        includeCollectives=True, includeStackTraces=True, onlyActive=False
    )
    Path(out_dir, f"rank{rank}").write_bytes(dump)
    os._exit(0)  # the collective in flight never ends: no orderly teardown
