"""Two-level gradient all-reduce: inside the node, then across nodes, then inside the node again.

A flat ring all-reduce sends every rank's whole bucket over the slowest link, 2(W-1)/W of it.
With `L` ranks per node and `N` nodes, the hierarchical one reduce-scatters the bucket inside
the node (fast links), all-reduces each rank's 1/L shard across nodes (one rank per node in
each inter-node group), and all-gathers inside the node: each rank puts 2(N-1)/N of a 1/L
shard on the inter-node link, L times less than flat. The inter-node hop may be compressed
(fp16); the intra-node hops stay exact.

Node groups come from the topology through PyTorch's `DeviceMesh` (`("node", "local")`, ranks
laid out node by node as torchrun numbers them). The hook's collectives are blocking and run
one bucket at a time on a thread of their own (`trainer.serial`), so buckets keep overlapping
backward and issue in the same order on every rank.

With a Monitor's meter in the state, each hop is timed (`CommMeter.hop`): the Monitor then
shows intra- and inter-node communication apart, with the bytes that crossed nodes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from meshscope.collector.comm import CommMeter, allgather_sent_bytes, allreduce_sent_bytes, bucket_bytes
from meshscope.trainer.serial import serial_hook

INTER_COMPRESSION = ("none", "fp16")  # what the inter-node hop may carry


@dataclass
class HierarchyState:
    """The two groups of this rank and how the inter-node hop is compressed."""

    local: Any  # this node's ranks
    across: Any  # the ranks with this local index on every node
    local_size: int
    nodes: int
    inter: str = "none"
    meter: CommMeter | None = None  # times each hop when a Monitor watches

    def hop(self, kind: str) -> Any:
        """A hop's timer, or nothing to time without a meter."""
        return self.meter.hop(kind) if self.meter is not None else contextlib.nullcontext()


def node_groups(local_size: int, inter: str = "none", device_type: str = "cpu") -> HierarchyState:
    """The node/local groups of a 2-D device mesh over the whole world (collective: every rank
    calls it at the same point)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if local_size < 1 or world % local_size:
        raise ValueError(f"train.hierarchical: {world} ranks do not split into nodes of {local_size}")
    mesh = init_device_mesh(device_type, (world // local_size, local_size), mesh_dim_names=("node", "local"))
    return HierarchyState(
        mesh.get_group("local"), mesh.get_group("node"), local_size, world // local_size, inter
    )


def hierarchical_allreduce(state: HierarchyState, bucket: dist.GradBucket) -> torch.Tensor:
    """The bucket averaged over the world in three hops (blocking; see the module doc)."""
    buffer = bucket.buffer()
    world = state.local_size * state.nodes
    flat = buffer.reshape(-1)
    pad = (-flat.numel()) % state.local_size
    # the bucket itself when it splits evenly: it is read by the scatter, then overwritten
    padded = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat
    shard = padded.new_empty(padded.numel() // state.local_size)
    with state.hop("intra_node"):
        dist.reduce_scatter_tensor(shard, padded, group=state.local)
    with state.hop("inter_node"):
        wire = shard.to(torch.float16) if state.inter == "fp16" else shard
        dist.all_reduce(wire, group=state.across)
        if wire is not shard:
            shard.copy_(wire)
    with state.hop("intra_node"):
        dist.all_gather_into_tensor(padded, shard, group=state.local)
    if pad:
        buffer.copy_(padded[: flat.numel()].view_as(buffer))
    return buffer.div_(world)


hierarchical_hook = serial_hook(hierarchical_allreduce, "hierarchical")


def hierarchical_wire_bytes(state: HierarchyState, bucket: dist.GradBucket, world_size: int) -> int:
    """Bytes one rank sends for a bucket: both intra-node hops and the inter-node one."""
    payload = bucket_bytes(bucket)
    shard = -(-payload // state.local_size)
    return (
        inter_node_bytes(state, bucket)
        + allgather_sent_bytes(shard, state.local_size)  # reduce-scatter sends as much
        + allgather_sent_bytes(shard, state.local_size)
    )


def inter_node_bytes(state: HierarchyState, bucket: dist.GradBucket, world_size: int = 0) -> int:
    """Bytes one rank sends across nodes for a bucket (its shard, ring all-reduced); the
    Monitor's `inter_bytes` signature (`world_size` is the state's)."""
    shard = -(-bucket_bytes(bucket) // state.local_size)
    if state.inter == "fp16":
        shard //= 2
    return allreduce_sent_bytes(shard, state.nodes)
