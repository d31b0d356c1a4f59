"""The control plane on a default group that refuses host tensors, as nccl and hccl do.

`cuda:gloo` maps only CUDA tensors to a backend, so a CPU tensor sent on it fails exactly like
on NCCL ("No backend type associated with device type cpu"): every collective meshscope adds
must still work there, through the plane's gloo side group.
"""

import pytest
import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry

from fixtures.dist import run_ranks
from meshscope.collector import DistEnv, Monitor, MonitorConfig
from meshscope.collector.control import ControlPlane, ControlPlaneError, LateFlag


class HostCountsMoE(torch.nn.Module):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank
        self.expert_token_counts = torch.zeros(3)

    def forward(self, x):
        self.expert_token_counts = torch.tensor([1.0, 2.0, 3.0]) * (self.rank + 1)
        return x


def control_on_an_accelerator_group(rank, world_size, run_dir):
    try:
        dist.all_reduce(torch.ones(1))  # what meshscope used to do: refused here, as on NCCL
        refused = ""
    except RuntimeError as err:
        refused = str(err)
    plane = ControlPlane()
    flag = LateFlag(plane)
    seen = [flag.exchange(rank == 1 and step == 2) for step in range(5)]
    flag.settle()
    mon = Monitor(
        MonitorConfig(run_dir=run_dir, metrics_port=None, expert_every=2),
        env=DistEnv(rank=rank, world_size=world_size),
        registry=CollectorRegistry(),
    )
    model = mon.watch(HostCountsMoE(rank))
    for _ in range(2):
        with mon.step():
            model(torch.ones(1))
    mon.close()
    return {
        "refused": refused,
        "side_group": plane.host_group is not plane.group,
        "round": plane.broadcast_int(40 + rank),
        "max": plane.agree_max(rank * 1.5),
        "stop_seen": seen,
    }


def test_every_meshscope_collective_survives_an_accelerator_only_group(tmp_path):
    from meshscope.collector.store import load_expert_load

    results = run_ranks(
        control_on_an_accelerator_group, 2, backend="cuda:gloo", run_dir=str(tmp_path / "run")
    )
    for r in results:
        assert "No backend type associated with device type cpu" in r["refused"]
        assert r["side_group"] and r["round"] == 40 and r["max"] == 1.5
        # raised by rank 1 after step 2, read by both ranks one exchange later
        assert r["stop_seen"] == [False, False, False, True, False]
    experts = load_expert_load(tmp_path / "run")
    assert experts.groupby("expert")["tokens"].sum().tolist() == [6.0, 12.0, 18.0]  # 1x + 2x


def control_traffic_apart(rank, world_size):
    plane = ControlPlane()
    with pytest.raises(ControlPlaneError, match="meta tensor cannot travel"):
        plane.all_reduce(torch.ones(1, device="meta"))
    # a rank one collective behind on the job's group still agrees on meshscope's
    work = dist.all_reduce(torch.ones(1), async_op=True) if rank == 0 else None
    agreed = plane.agree_max(float(rank))
    if rank == 1:
        dist.all_reduce(torch.ones(1))
    if work is not None:
        work.wait()
    return plane.host_group is not plane.group, agreed


def test_on_gloo_too_meshscope_talks_on_a_group_of_its_own():
    assert run_ranks(control_traffic_apart, 2) == [(True, 1.0), (True, 1.0)]
