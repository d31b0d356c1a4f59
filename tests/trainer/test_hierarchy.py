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
