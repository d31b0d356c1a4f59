"""A small MoE transformer language model whose MoE layers speak the Monitor's protocol.

Each `MoEFeedForward` keeps `expert_token_counts` (tokens routed per expert in the last forward,
before capacity dropping) and its auxiliary losses (Switch load balancing, router z-loss).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig


class Router(nn.Module):
    """Top-k softmax router with load-balancing and z-loss."""

    def __init__(self, d_model: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, experts, bias=False)
        self.experts, self.top_k = experts, top_k
        self.logit_bias: torch.Tensor | None = None  # set by fault injection to skew routing

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, d] -> (weights [T, k], experts [T, k], aux loss, z loss)."""
        logits = self.gate(x).float()
        if self.logit_bias is not None:
            logits = logits + self.logit_bias
        probs = logits.softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        # Switch-style balance loss: fraction of assignments x mean probability, per expert.
        assigned = F.one_hot(chosen, self.experts).sum(dim=1).float()  # [T, E]
        fraction = assigned.mean(dim=0) / self.top_k
        aux = self.experts * torch.sum(fraction * probs.mean(dim=0))
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        return weights.to(x.dtype), chosen, aux, z


class MoEFeedForward(nn.Module):
    """Experts with capacity: tokens beyond an expert's capacity skip it (residual carries them)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = cfg.ffn_mult * cfg.d_model
        self.router = Router(cfg.d_model, cfg.experts, cfg.top_k)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(cfg.d_model, hidden), nn.GELU(), nn.Linear(hidden, cfg.d_model))
            for _ in range(cfg.experts))
        self.capacity_factor = cfg.capacity_factor
        # The Monitor's MoE protocol; a plain attribute (not a buffer) so DDP never syncs it.
        self.expert_token_counts = torch.zeros(cfg.experts)
        self.aux_loss = torch.zeros(())
        self.z_loss = torch.zeros(())

    def capacity(self, tokens: int) -> int:
        k, e = self.router.top_k, len(self.experts)
        return max(1, math.ceil(self.capacity_factor * tokens * k / e))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, chosen, self.aux_loss, self.z_loss = self.router(flat)
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts))
        self.expert_token_counts = counts.to(self.expert_token_counts.dtype)
        out = torch.zeros_like(flat)
        cap = self.capacity(flat.shape[0])
        for e, expert in enumerate(self.experts):
            token_idx, slot = torch.nonzero(chosen == e, as_tuple=True)
            token_idx, slot = token_idx[:cap], slot[:cap]  # capacity: first come, first served
            # An expert with no tokens still runs on an empty batch, so DDP sees its gradients.
            y = expert(flat[token_idx]) * weights[token_idx, slot].unsqueeze(-1)
            out.index_add_(0, token_idx, y)
        return out.reshape(shape)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = nn.MultiheadAttention(cfg.d_model, cfg.heads, batch_first=True)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.moe = MoEFeedForward(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.moe(self.ln2(x))


class MoELM(nn.Module):
    """Decoder-only LM: embeddings, blocks with MoE feed-forwards, tied output head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        nn.init.normal_(self.pos, std=0.02)
        nn.init.normal_(self.embed.weight, std=0.02)

    def moe_layers(self) -> list[MoEFeedForward]:
        return [b.moe for b in self.blocks]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=tokens.device), diagonal=1)
        x = self.embed(tokens) + self.pos[:t]
        for block in self.blocks:
            x = block(x, mask)
        return self.ln_f(x) @ self.embed.weight.T

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(total loss to optimise, language-model loss to report) for the last forward."""
        lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        aux = sum(m.aux_loss for m in self.moe_layers())
        z = sum(m.z_loss for m in self.moe_layers())
        return lm + self.cfg.aux_loss_coef * aux + self.cfg.z_loss_coef * z, lm
