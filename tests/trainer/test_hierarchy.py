"""The two-level all-reduce gives DDP the same gradients as the flat one, on 2 "nodes" of 2
ranks, and puts a node's share of the bucket on the inter-node link."""

from __future__ import annotations

import pytest
import torch

from fixtures.dist import run_ranks


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


def _monitored(rank: int, world_size: int, variant: str, run_dir: str) -> dict:
    """Three steps of a DDP model watched by a Monitor on 2 "nodes" x 2 ranks (`variant`: flat,
    hierarchical, hierarchical-fp16): each step's record, what the hook says it sent across
    nodes, and the final gradients."""
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
    # odd sizes: every bucket pads to split in the node
    model = torch.nn.Sequential(torch.nn.Linear(63, 31), torch.nn.Linear(31, 5))
    ddp = DDP(model, bucket_cap_mb=0.004)  # two buckets
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank % 2, local_world_size=2, torchrun=True)
    config = MonitorConfig(run_dir=Path(run_dir) / str(rank), metrics_port=None, flight_log=False)
    mon = Monitor(config, env=env, registry=CollectorRegistry())
    expected = []
    hierarchical = variant.startswith("hierarchical")
    if hierarchical:
        groups = node_groups(2, "fp16" if variant.endswith("fp16") else "none")
        groups.meter = mon.meter
        hook, state, wire, inter = hierarchical_hook, groups, hierarchical_wire_bytes, inter_node_bytes
    else:
        hook, state, wire, inter = allreduce_hook, None, allreduce_wire_bytes, None

    def counted(s, bucket):  # what the hook itself says crosses nodes, bucket by bucket
        expected.append(inter_node_bytes(groups, bucket) if hierarchical else 0)
        return hook(s, bucket)

    counted.__annotations__ = hook.__annotations__
    mon.watch(ddp, comm_hook=counted, hook_state=state, wire_bytes=wire, inter_bytes=inter)
    sent = []
    torch.manual_seed(rank + 1)
    for _ in range(3):
        with mon.step(tokens=4):
            ddp(torch.randn(4, 63)).pow(2).sum().backward()
        sent.append(sum(expected))
        expected.clear()
    mon.close()
    rows = load_steps(config.run_dir).sort_values("step").to_dict("records")
    grads = [p.grad.flatten().tolist() for p in model.parameters()]
    return {"rows": [dict(r, hook_inter=s) for r, s in zip(rows, sent)], "grads": grads}


def test_hierarchical_equals_flat_and_the_monitor_shows_its_hops_apart(tmp_path):
    import math

    runs = {
        v: run_ranks(_monitored, 4, variant=v, run_dir=str(tmp_path / v))
        for v in ("flat", "hierarchical", "hierarchical-fp16")
    }
    flat, two_level, half = runs["flat"], runs["hierarchical"], runs["hierarchical-fp16"]
    for rank in range(4):
        for a, b, c in zip(flat[rank]["grads"], two_level[rank]["grads"], half[rank]["grads"]):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6), (a, b)
            assert torch.allclose(torch.tensor(a), torch.tensor(c), rtol=1e-2, atol=1e-3), (a, c)
        for row in two_level[rank]["rows"] + half[rank]["rows"]:
            assert row["comm_intra_s"] > 0 and row["comm_inter_s"] > 0, row
            assert row["bytes_inter"] == row["hook_inter"] > 0, row  # the hook's own count
            assert row["bytes_inter"] < row["bytes_wire"]
        for row in flat[rank]["rows"]:
            # one flat ring: not timed apart, and a rank's share is 1/2 of what it sends
            assert math.isnan(row["comm_intra_s"]) and math.isnan(row["comm_inter_s"]), row
            assert row["bytes_inter"] == row["bytes_wire"] // 2 > 0, row
        # the same gradients cross nodes: 2/3 of the flat ring's bytes (see the module doc),
        # half that again with fp16 on the inter-node hop
        inter = {v: r[rank]["rows"][-1]["bytes_inter"] for v, r in runs.items()}
        assert 0.6 < inter["hierarchical"] / inter["flat"] < 0.72, inter
        assert inter["hierarchical-fp16"] == pytest.approx(inter["hierarchical"] / 2, rel=0.02), inter
    assert flat[0]["grads"] == flat[3]["grads"]  # all ranks agree: it is an all-reduce
