"""Raw and wire bytes are one count, so raw / wire is the compression ratio at any world size."""

from __future__ import annotations

import types

import torch

from meshscope.collector.comm import CommMeter, allreduce_wire_bytes, instrument_hook
from meshscope.collector.probe import HostProbe


def _bucket(numel: int):
    buffer = torch.zeros(numel)
    return types.SimpleNamespace(buffer=lambda: buffer)


def test_an_uncompressed_all_reduce_has_a_compression_ratio_of_one_at_four_ranks():
    meter = CommMeter(HostProbe())
    meter.take(sample_next=False)
    fut = torch.futures.Future()
    hook = instrument_hook(lambda _state, _bucket: fut, meter, allreduce_wire_bytes, world_size=4)
    hook(None, _bucket(1000))
    window = meter.take()
    assert window.bytes_raw == window.bytes_wire == 2 * 3 * 4000 // 4  # what a ring all-reduce sends


def test_fp16_halves_what_is_sent_at_four_ranks():
    meter = CommMeter(HostProbe())
    meter.take(sample_next=False)
    half = lambda state, bucket, world: allreduce_wire_bytes(state, bucket, world) // 2  # noqa: E731
    instrument_hook(lambda *_: torch.futures.Future(), meter, half, world_size=4)(None, _bucket(1000))
    window = meter.take()
    assert window.bytes_raw / window.bytes_wire == 2.0


def test_the_backward_watch_finds_the_graph_of_any_output_shape():
    from meshscope.collector.comm import _grad_node

    w = torch.ones(2, requires_grad=True)
    y = w * 2
    assert _grad_node(y) is y.grad_fn
    assert _grad_node((torch.zeros(1), y)) is y.grad_fn  # a flat tuple: its first tensor with a graph
    assert _grad_node({"aux": [torch.zeros(1), (y,)]}) is y.grad_fn  # nested: found by the tree walk
    assert _grad_node((torch.zeros(1), "text")) is None and _grad_node(y.detach()) is None
