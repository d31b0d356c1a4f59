import math

import pytest
import torch

from meshscope.collector.moe import find_moe_layers
from meshscope.trainer.config import ModelConfig
from meshscope.trainer.data import SyntheticTokens
from meshscope.trainer.model import MoEFeedForward, MoELM, Router


def test_router_counts_sum_to_tokens_times_top_k():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, heads=2, experts=4, top_k=2)
    moe = MoEFeedForward(cfg)
    x = torch.randn(3, 10, 16)
    moe(x)
    assert moe.expert_token_counts.shape == (4,)
    assert moe.expert_token_counts.sum().item() == 3 * 10 * 2


def test_aux_loss_is_one_when_balanced_and_grows_with_collapse():
    torch.manual_seed(0)
    router = Router(d_model=8, experts=4, top_k=1)
    torch.nn.init.zeros_(router.gate.weight)  # uniform probabilities
    x = torch.randn(400, 8)
    # Uniform probs, ties broken to one expert: fraction concentrated, but P_e = 1/E -> aux = 1.
    _, _, aux_uniform, _ = router(x)
    assert aux_uniform.item() == pytest.approx(1.0, abs=1e-5)
    torch.nn.init.normal_(router.gate.weight, std=0.01)
    _, _, aux_spread, _ = router(x)
    router.logit_bias = torch.tensor([8.0, 0.0, 0.0, 0.0])  # collapse onto expert 0
    _, chosen, aux_collapsed, _ = router(x)
    assert (chosen == 0).all()
    assert aux_spread.item() < 1.2
    assert aux_collapsed.item() > 3.5  # -> E = 4 as the collapse becomes total


def test_aux_loss_gradient_pushes_toward_balance():
    router = Router(d_model=4, experts=2, top_k=1)
    with torch.no_grad():
        router.gate.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0]]))
    x = torch.ones(64, 4)
    _, _, aux, _ = router(x)
    aux.backward()
    # Expert 0 gets everything; descending the loss lowers expert 0's logit.
    assert router.gate.weight.grad[0, 0] > 0


def test_z_loss_grows_with_logit_scale():
    router = Router(d_model=8, experts=4, top_k=2)
    x = torch.randn(32, 8)
    z_small = router(x * 0.1)[3].item()
    z_big = router(x * 10)[3].item()
    assert 0 <= z_small < z_big


def test_capacity_drops_overflow_tokens():
    cfg = ModelConfig(d_model=8, heads=2, experts=2, top_k=1, capacity_factor=0.5)
    moe = MoEFeedForward(cfg)
    moe.router.logit_bias = torch.tensor([10.0, 0.0])
    x = torch.randn(1, 40, 8)
    out = moe(x).reshape(40, 8)
    served = (out.abs().sum(dim=1) > 0).sum().item()
    assert served == moe.capacity(40) == 10
    assert moe.expert_token_counts.tolist() == [40.0, 0.0]  # counted before dropping


def test_model_exposes_moe_protocol_and_learns():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, seq_len=16, layers=2, d_model=32, heads=2, experts=4, top_k=2)
    model = MoELM(cfg)
    assert len(find_moe_layers(model)) == 2
    data = SyntheticTokens(vocab_size=32, seq_len=16, batch_size=16, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(40):
        x, y = data.batch(step)
        loss, lm = model.loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(lm.item())
    assert losses[0] == pytest.approx(math.log(32), rel=0.1)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.8
