"""The sync-free dispatch computes what the old per-expert loop computed, gradients included.

`loop_reference` is the previous implementation (a `nonzero` per expert, first come first served
up to capacity, `index_add_` back), kept here as the specification.
"""

import pytest
import torch

from fixtures.moe_reference import loop_reference
from meshscope.trainer.config import ModelConfig
from meshscope.trainer.model import MoEFeedForward


@pytest.mark.parametrize(
    "experts,top_k,factor,skew",
    [
        (4, 2, 1.25, 0.0),
        (8, 2, 1.0, 3.0),
        (8, 1, 0.5, 0.0),
        (4, 4, 1.0, 5.0),
        (16, 2, 2.0, 8.0),
        (3, 2, 0.3, 20.0),
    ],
)
def test_dispatch_matches_the_loop(experts, top_k, factor, skew):
    torch.manual_seed(experts * 10 + top_k)
    cfg = ModelConfig(d_model=16, heads=2, experts=experts, top_k=top_k, capacity_factor=factor)
    moe = MoEFeedForward(cfg).double()
    if skew:  # some experts overflow their capacity: dropping must match too
        moe.router.logit_bias = torch.linspace(skew, 0, experts, dtype=torch.float64)
    x = torch.randn(3, 21, 16, dtype=torch.float64, requires_grad=True)
    fast = moe(x)
    grads_fast = torch.autograd.grad(fast.pow(2).sum(), [x, *moe.parameters()])
    slow = loop_reference(moe, x)
    grads_slow = torch.autograd.grad(slow.pow(2).sum(), [x, *moe.parameters()], allow_unused=True)
    torch.testing.assert_close(fast, slow)
    for a, b in zip(grads_fast, grads_slow):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b)
    counts = torch.bincount(moe.router(x.reshape(-1, 16))[1].flatten(), minlength=experts)
    assert moe.expert_token_counts.tolist() == counts.double().tolist()


def test_dispatch_never_reads_a_device_value(monkeypatch):
    """Every op that would make the host wait on an accelerator is refused during a step."""
    cfg = ModelConfig(d_model=16, heads=2, experts=4, top_k=2)
    moe = MoEFeedForward(cfg)
    x = torch.randn(2, 8, 16)

    def refuse(name):
        def call(*a, **k):
            raise AssertionError(f"{name} in the MoE step: a host-device sync on accelerators")

        return call

    for name in ("nonzero", "bincount", "unique", "masked_select"):
        monkeypatch.setattr(torch, name, refuse(f"torch.{name}"))
        monkeypatch.setattr(torch.Tensor, name, refuse(f"Tensor.{name}"))
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, refuse(f"Tensor.{name}"))
    getitem = torch.Tensor.__getitem__

    def no_boolean_indexing(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts):
            raise AssertionError("boolean indexing in the MoE step: its size is a device value")
        return getitem(self, index)

    monkeypatch.setattr(torch.Tensor, "__getitem__", no_boolean_indexing)
    moe(x).sum().backward()
