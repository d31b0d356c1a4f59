"""A small MoE transformer language model whose MoE layers speak the Monitor's protocol.

Each `MoEFeedForward` keeps `expert_token_counts` (tokens routed per expert in the last forward,
before capacity dropping) and its auxiliary losses (Switch load balancing, router z-loss).

Routing never waits for the device (but for expert parallelism's dropless dispatch, which
reads its all-to-all splits on the host: trainer/experts.py): static-capacity dispatch (every
expert gets a padded [capacity, d] slot table, filled by index arithmetic on one-hot cumulative
sums), one batched matmul for all experts, counts by one-hot sums. No `nonzero`, boolean
indexing, `bincount` or `.item()`: shapes depend on configuration only, so the host never
reads a device value.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshscope.trainer.config import ModelConfig
from meshscope.trainer.experts import ExpertMesh, dispatch_and_combine, dropless_dispatch, slot_order


class Router(nn.Module):
    """Top-k softmax router with load-balancing and z-loss."""

    def __init__(self, d_model: int, experts: int, top_k: int, skew: float = 0.0) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, experts, bias=False)
        self.experts, self.top_k = experts, top_k
        self.skew = skew  # a fixed preference for expert 0 (experiments with a skewed router)
        self.logit_bias: torch.Tensor | None = None  # set by fault injection to skew routing
        # Aux-loss-free balancing (DeepSeek-V3): a per-expert bias that moves selection only,
        # never the gate weights; set through the control channel, updated from global loads.
        self.routing_bias: torch.Tensor | None = None
        self.bias_rate = 0.0

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, d] -> (weights [T, k], experts [T, k], aux loss, z loss)."""
        logits = self.gate(x).float()
        if self.skew:
            logits = (
                logits
                + F.one_hot(torch.zeros((), dtype=torch.long, device=x.device), self.experts) * self.skew
            )
        if self.logit_bias is not None:
            logits = logits + self.logit_bias
        probs = logits.softmax(dim=-1)
        if self.routing_bias is None:
            weights, chosen = probs.topk(self.top_k, dim=-1)
        else:
            chosen = (logits + self.routing_bias).topk(self.top_k, dim=-1).indices
            weights = probs.gather(-1, chosen)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        # Switch-style balance loss: fraction of assignments x mean probability, per expert.
        assigned = F.one_hot(chosen, self.experts).sum(dim=1).float()  # [T, E]
        fraction = assigned.mean(dim=0) / self.top_k
        aux = self.experts * torch.sum(fraction * probs.mean(dim=0))
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        return weights.to(x.dtype), chosen, aux, z


class GroupedExperts(nn.Module):
    """E two-layer MLPs held as stacked weights, so one batched matmul runs them all."""

    def __init__(self, experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, d_model, hidden))
        self.b1 = nn.Parameter(torch.empty(experts, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, d_model))
        self.b2 = nn.Parameter(torch.empty(experts, d_model))
        with torch.no_grad():  # nn.Linear's initialisation, expert by expert
            for w, b, fan_in in ((self.w1, self.b1, d_model), (self.w2, self.b2, hidden)):
                bound = 1 / math.sqrt(fan_in)
                w.uniform_(-bound, bound)
                b.uniform_(-bound, bound)

    def __len__(self) -> int:
        return self.w1.shape[0]

    def one(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `index` alone over its own tokens, x: [n, d] -> [n, d] (dropless dispatch)."""
        h = F.gelu(torch.addmm(self.b1[index], x, self.w1[index]))
        return torch.addmm(self.b2[index], h, self.w2[index])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [E, C, d] (expert e's slot table) -> [E, C, d]."""
        h = F.gelu(torch.baddbmm(self.b1.unsqueeze(1), x, self.w1))
        return torch.baddbmm(self.b2.unsqueeze(1), h, self.w2)


class MoEFeedForward(nn.Module):
    """Experts with capacity: tokens beyond an expert's capacity skip it (residual carries them)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.router = Router(cfg.d_model, cfg.experts, cfg.top_k, cfg.router_skew)
        self.experts = GroupedExperts(cfg.experts, cfg.d_model, cfg.ffn_mult * cfg.d_model)
        self.capacity_factor = cfg.capacity_factor
        # The Monitor's MoE protocol; a plain attribute (not a buffer) so DDP never syncs it.
        self.expert_token_counts = torch.zeros(cfg.experts, dtype=torch.int64)  # whole tokens
        self.aux_loss = torch.zeros(())
        self.z_loss = torch.zeros(())
        # Expert parallelism (trainer/experts.py): this layer holds only its EP rank's experts
        # and exchanges slots with its EP peers; `expert_work` counts the tokens they processed.
        self.expert_mesh: ExpertMesh | None = None
        self.expert_work = torch.zeros(0)

    def capacity(self, tokens: int) -> int:
        """Tokens each expert takes at most in a batch of `tokens`."""
        k, e = self.router.top_k, self.router.experts
        return max(1, math.ceil(self.capacity_factor * tokens * k / e))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        tokens, d = flat.shape
        weights, chosen, self.aux_loss, self.z_loss = self.router(flat)
        experts, k, cap = self.router.experts, self.router.top_k, self.capacity(tokens)
        # Assignments in (token, choice) order; an expert serves them first come, first served.
        assigned = F.one_hot(chosen.reshape(-1), experts)  # [T*k, E]
        self.expert_token_counts = assigned.sum(dim=0).to(self.expert_token_counts.dtype)
        if self.expert_mesh is not None and self.expert_mesh.dropless:
            slot_of = slot_order(self)[1][chosen]
            out, work = dropless_dispatch(flat, slot_of, weights, self.experts, self.expert_mesh, experts)
            self.expert_work = work
            return out.reshape(shape)
        queue_pos = ((assigned.cumsum(dim=0) - 1) * assigned).sum(dim=1)
        kept = queue_pos < cap
        spare = experts * cap  # one extra row takes every dropped assignment
        slot = torch.where(kept, chosen.reshape(-1) * cap + queue_pos, spare)
        source = flat.repeat_interleave(k, dim=0)  # row i = the token of assignment i
        if self.expert_mesh is None:
            table = flat.new_zeros(spare + 1, d).index_copy(0, slot, source)
            y = self.experts(table[:spare].view(experts, cap, d)).reshape(spare, d)
        else:  # a last column marks the filled slots, so the holder counts what it processed
            source = torch.cat([source, source.new_ones(source.shape[0], 1)], dim=1)
            table = flat.new_zeros(spare + 1, d + 1).index_copy(0, slot, source)
            order, where = slot_order(self)  # expert tables in slot order, and back
            slots = table[:spare].view(experts, cap, d + 1).index_select(0, order)
            y, work = dispatch_and_combine(slots, self.experts, self.expert_mesh)
            self.expert_work = work.detach()
            y = y.index_select(0, where).reshape(spare, d)
        y = torch.cat([y, y.new_zeros(1, d)])
        gate = (weights.reshape(-1) * kept).unsqueeze(-1)  # dropped assignments add nothing
        out = (y.index_select(0, slot) * gate).view(tokens, k, d).sum(dim=1)
        return out.reshape(shape)


class Block(nn.Module):
    """A transformer block: attention, then the MoE feed-forward."""

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
        self.aux_loss_coef = cfg.aux_loss_coef  # the control channel may change it mid-run
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        nn.init.normal_(self.pos, std=0.02)
        nn.init.normal_(self.embed.weight, std=0.02)

    def moe_layers(self) -> list[MoEFeedForward]:
        """The MoE layers, in order (what the Monitor reads counts from)."""
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
        return lm + self.aux_loss_coef * aux + self.cfg.z_loss_coef * z, lm
