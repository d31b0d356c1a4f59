"""The MoE protocol: how the Monitor sees any MoE layer, ours or a user's.

A module is an MoE layer for meshscope if it has an attribute `expert_token_counts`: a 1-D
tensor, one entry per expert, holding the tokens routed to each expert in its last forward
(before capacity dropping, so the entries sum to tokens x top_k). The tensor may live on the
device; the Monitor reads it without a sync and sums it over ranks every few steps.
"""

from __future__ import annotations

import torch

PROTOCOL_ATTRIBUTE = "expert_token_counts"


def is_moe_layer(module: torch.nn.Module) -> bool:
    """Whether `module` follows the MoE protocol (exposes its per-expert token counts)."""
    return isinstance(getattr(module, PROTOCOL_ATTRIBUTE, None), torch.Tensor)


def find_moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """MoE layers in definition order; their index is the `layer` label."""
    return [m for m in model.modules() if is_moe_layer(m)]
