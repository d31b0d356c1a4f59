"""The simulated accelerator behaves like NCCL/HCCL, not like gloo: enqueue is not completion,
events pass when the stream gets there, and what the real libraries refuse is refused."""

from __future__ import annotations

import threading

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
