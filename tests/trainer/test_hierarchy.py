"""The two-level all-reduce gives DDP the same gradients as the flat one, on 2 "nodes" of 2
ranks, and puts a node's share of the bucket on the inter-node link."""

from __future__ import annotations

import torch

from fixtures.dist import run_ranks


def _grads(rank: int, world_size: int, hierarchical: bool, inter: str = "none") -> list[list[float]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from meshscope.trainer.hierarchy import hierarchical_hook, node_groups

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))  # odd sizes: padding
    ddp = DDP(model, bucket_cap_mb=0.0001)  # several buckets
    if hierarchical:
        ddp.register_comm_hook(node_groups(2, inter), hierarchical_hook)
    torch.manual_seed(rank + 1)
    for _ in range(2):
        ddp(torch.randn(4, 7)).pow(2).sum().backward()
    return [p.grad.flatten().tolist() for p in model.parameters()]


def test_hierarchical_equals_flat_and_fp16_on_the_inter_hop_is_close():
    flat = run_ranks(_grads, 4, hierarchical=False)
    two_level = run_ranks(_grads, 4, hierarchical=True)
    half = run_ranks(_grads, 4, hierarchical=True, inter="fp16")
    for r in range(4):
        for a, b, c in zip(flat[r], two_level[r], half[r]):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6), (a, b)
            assert torch.allclose(torch.tensor(a), torch.tensor(c), rtol=1e-2, atol=1e-3), (a, c)
    assert flat[0] == flat[3]  # all ranks agree: it is an all-reduce


def test_the_inter_node_hop_carries_a_shard():
    from types import SimpleNamespace

    from meshscope.trainer.hierarchy import HierarchyState, hierarchical_wire_bytes, inter_node_bytes

    bucket = SimpleNamespace(buffer=lambda: torch.zeros(1024))  # 4 KiB
    state = HierarchyState(None, None, local_size=8, nodes=4)
    assert inter_node_bytes(state, bucket) == 2 * 3 * 512 // 4  # a 1/8 shard, ring over 4 nodes
    flat = 2 * 31 * 4096 // 32
    assert inter_node_bytes(state, bucket) < flat / 8 + 1
    assert hierarchical_wire_bytes(state, bucket, 32) > inter_node_bytes(state, bucket)
    half = HierarchyState(None, None, local_size=8, nodes=4, inter="fp16")
    assert inter_node_bytes(half, bucket) == inter_node_bytes(state, bucket) // 2


def _monitored(rank: int, world_size: int, hierarchical: bool, run_dir: str) -> list[dict]:
    """Three steps of a DDP model watched by a Monitor on 2 "nodes" x 2 ranks: each step's
    record, and what the hook says it sent across nodes."""
    from pathlib import Path

    from prometheus_client import CollectorRegistry
    from torch.nn.parallel import DistributedDataParallel as DDP

    from meshscope.collector.comm import allreduce_wire_bytes
    from meshscope.collector.env import DistEnv
    from meshscope.collector.flightlog import allreduce_hook
    from meshscope.collector.monitor import Monitor
    from meshscope.collector.monitor_config import MonitorConfig
    from meshscope.collector.store import load_steps
    from meshscope.trainer.hierarchy import (
        hierarchical_hook,
        hierarchical_wire_bytes,
        inter_node_bytes,
        node_groups,
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    ddp = DDP(model, bucket_cap_mb=0.01)
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank % 2, local_world_size=2, torchrun=True)
    config = MonitorConfig(run_dir=Path(run_dir) / str(rank), metrics_port=None, flight_log=False)
    mon = Monitor(config, env=env, registry=CollectorRegistry())
    expected = []
    if hierarchical:
        groups = node_groups(2)
        groups.meter = mon.meter
        hook, state, wire, inter = hierarchical_hook, groups, hierarchical_wire_bytes, inter_node_bytes
    else:
        hook, state, wire, inter = allreduce_hook, None, allreduce_wire_bytes, None

    def counted(s, bucket):  # what the hook itself says crosses nodes, bucket by bucket
        expected.append(inter_node_bytes(groups, bucket) if hierarchical else None)
        return hook(s, bucket)

    counted.__annotations__ = hook.__annotations__
    mon.watch(ddp, comm_hook=counted, hook_state=state, wire_bytes=wire, inter_bytes=inter)
    sent = []
    for _ in range(3):
        with mon.step(tokens=4):
            ddp(torch.randn(4, 64)).pow(2).sum().backward()
        sent.append(sum(b for b in expected if b is not None))
        expected.clear()
    mon.close()
    rows = load_steps(config.run_dir).sort_values("step").to_dict("records")
    return [dict(r, hook_inter=s) for r, s in zip(rows, sent)]


def test_the_monitor_shows_intra_and_inter_node_communication_apart(tmp_path):
    import math

    two_level = run_ranks(_monitored, 4, hierarchical=True, run_dir=str(tmp_path / "h"))
    flat = run_ranks(_monitored, 4, hierarchical=False, run_dir=str(tmp_path / "f"))
    for rank in range(4):
        for row in two_level[rank]:
            assert row["comm_intra_s"] > 0 and row["comm_inter_s"] > 0, row
            assert row["bytes_inter"] == row["hook_inter"] > 0, row  # the hook's own count
            assert row["bytes_inter"] < row["bytes_wire"]
        for row in flat[rank]:
            # one flat ring: not timed apart, and a rank's share is 1/2 of what it sends
            assert math.isnan(row["comm_intra_s"]) and math.isnan(row["comm_inter_s"]), row
            assert row["bytes_inter"] == row["bytes_wire"] // 2 > 0, row
        # the same gradients cross nodes: 2/3 of the flat ring's bytes (see the module doc)
        ratio = two_level[rank][-1]["bytes_inter"] / flat[rank][-1]["bytes_inter"]
        assert 0.6 < ratio < 0.72, ratio
