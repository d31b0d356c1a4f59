"""The simulated accelerator behaves like NCCL/HCCL, not like gloo: enqueue is not completion,
events pass when the stream gets there, and what the real libraries refuse is refused."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fixtures.dist import run_ranks
from meshscope.trainer import sim


def _semantics(rank: int, world_size: int) -> dict:
    gate = threading.Event()
    sim.stream().enqueue(gate.wait)  # the device is busy with earlier work
    t = torch.full((4,), float(rank + 1))
    work = dist.all_reduce(t, async_op=True)
    event = sim.SIM.Event(enable_timing=True)
    event.record()
    seen = {
        "future_done_at_once": work.get_future().done(),
        "completed_while_busy": work.is_completed(),
        "event_passed_while_busy": event.query(),
        "data_before": t.tolist(),
    }
    gate.set()
    work.wait()
    event.synchronize()
    seen.update(completed=work.is_completed(), event_passed=event.query(), data_after=t.tolist())
    refusals = {}
    for name, call in {
        "float64": lambda: dist.all_reduce(torch.ones(2, dtype=torch.float64)),
        "meta": lambda: dist.all_reduce(torch.empty(2, device="meta")),
    }.items():
        try:
            call()
            refusals[name] = ""
        except Exception as err:  # noqa: BLE001
            refusals[name] = str(err)
    dist.broadcast(torch.ones(2, dtype=torch.float64), src=0)  # HCCL broadcasts float64
    seen["refusals"] = refusals
    return seen


@pytest.mark.parametrize("backend", ["simnccl", "simhccl"])
def test_collectives_return_at_once_and_complete_on_the_stream(backend):
    for seen in run_ranks(_semantics, 2, backend=backend):
        assert seen["future_done_at_once"] and not seen["completed_while_busy"]
        assert not seen["event_passed_while_busy"] and seen["data_before"] != [3.0] * 4
        assert seen["completed"] and seen["event_passed"] and seen["data_after"] == [3.0] * 4
        assert "Tensors must be cpu and dense" in seen["refusals"]["meta"]
        if backend == "simhccl":
            assert "HCCL does not support float64" in seen["refusals"]["float64"]
        else:
            assert seen["refusals"]["float64"] == ""


def test_a_hung_stream_blocks_the_host_only_when_its_launch_queue_is_full():
    stream = sim.SimStream()
    stream.hang()
    stream.enqueue(lambda: None)  # the kernel the stream is stuck in
    blocked = threading.Event()

    def launch_more():
        for _ in range(sim.LAUNCH_QUEUE + 1):
            stream.enqueue(lambda: None)
        blocked.set()

    threading.Thread(target=launch_more, daemon=True).start()
    assert not blocked.wait(1.0), "a full launch queue must block the host"


def _flight_states(log, ops: tuple[str, ...]) -> list[str]:
    from meshscope.collector.flightread import read_flight

    return [r.state for r in read_flight(log.path).records if r.op in ops]


def _settled(log, ops: tuple[str, ...], timeout_s: float = 20.0) -> list[str]:
    """The flight log's states of `ops` once the device thread has decided every one."""
    deadline = time.monotonic() + timeout_s
    while "issued" in (states := _flight_states(log, ops)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return states


def _device_log(rank: int, world_size: int, folder: str):
    from meshscope.collector.flightlog import FlightLog
    from meshscope.trainer.device import Device

    sim.SIM.set_device(rank)
    probe = Device("sim", rank).probe()
    return FlightLog(
        Path(folder), rank=rank, world_size=world_size, probe=probe, device_poll_s=0.01
    ).install()


def _coalesced(rank: int, world_size: int, folder: str) -> dict:
    """NCCL's coalescing: a block's ops launch together at its end; each op's own Work has no
    end event recorded and queries as complete at once; the block's Work is the truth."""
    from meshscope.collector.flightlog import FlightLog

    log = _device_log(rank, world_size, f"{folder}/{rank}")
    gate = threading.Event()
    sim.stream().enqueue(gate.wait)  # the device is busy with earlier work
    peer = 1 - rank
    send, recv = torch.full((3,), float(rank + 1)), torch.zeros(3)
    group = dist.distributed_c10d._get_default_group()
    with dist._coalescing_manager(group, device=torch.device("cpu"), async_ops=True) as block:
        ops = [dist.isend(send, peer), dist.irecv(recv, peer)]
    time.sleep(0.3)  # many rounds of the device thread's queries (every 10 ms)
    seen = {
        "ops_completed_while_busy": [w.is_completed() for w in ops],
        "block_completed_while_busy": block.works[0].is_completed(),
        "logged_while_busy": _flight_states(log, ("isend", "irecv")),
    }
    gate.set()
    block.wait()
    seen.update(recv=recv.tolist(), logged=_settled(log, ("isend", "irecv")), contexts=sorted(sim.contexts()))
    log.close()
    FlightLog.uninstall()
    return seen


def test_a_coalesced_block_completes_with_its_end_not_with_its_ops(tmp_path):
    for rank, seen in enumerate(run_ranks(_coalesced, 2, backend="simnccl", folder=str(tmp_path))):
        assert seen["ops_completed_while_busy"] == [True, True]  # NCCL's unrecorded events
        assert not seen["block_completed_while_busy"]
        assert seen["logged_while_busy"] == ["issued", "issued"], seen  # the log waits for the block
        assert seen["recv"] == [float(2 - rank)] * 3
        assert seen["logged"] == ["completed", "completed"], seen
        # the device-truth thread bound itself to the rank's device before its first query
        assert seen["contexts"] == [rank], seen


def _failure(rank: int, world_size: int, folder: str) -> dict:
    """A collective only rank 0 calls, on a group whose timeout is short: it fails on the
    stream. As on NCCL: completed (with an error), a COMM_ERROR result, isSuccess refused."""
    from datetime import timedelta

    from meshscope.collector.flightlog import FlightLog

    log = _device_log(rank, world_size, f"{folder}/{rank}")
    short = dist.new_group(backend="simnccl", timeout=timedelta(seconds=1))
    seen: dict = {}
    if rank == 0:
        work = dist.all_reduce(torch.ones(2), group=short, async_op=True)
        seen["result"] = int(work.get_future_result().wait())
        seen["completed"] = work.is_completed()
        try:
            work.is_success()
        except NotImplementedError as err:
            seen["is_success"] = str(err)
        seen["logged"] = _settled(log, ("all_reduce",))
    log.close()
    FlightLog.uninstall()
    return seen


def test_a_failed_collective_is_completed_with_an_error_and_the_log_says_failed(tmp_path):
    from torch._C._distributed_c10d import WorkResult

    seen = run_ranks(_failure, 2, backend="simnccl", folder=str(tmp_path))[0]
    assert seen["result"] == int(WorkResult.COMM_ERROR) and seen["completed"], seen
    assert "deprecated" in seen["is_success"]
    assert seen["logged"] == ["failed"], seen
