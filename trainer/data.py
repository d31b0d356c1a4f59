"""A deterministic, rank-sharded synthetic token stream with structure a model can learn.

Tokens follow a fixed sparse Markov chain (each token has `branching` likely successors), so the
loss falls from log(vocab) toward log(branching). Batch (step, rank) is a pure function of the
seed: resuming from a step needs no state, and a changed world size re-shards cleanly.
"""

from __future__ import annotations

import torch


class SyntheticTokens:
    """Deterministic token batches per rank: a learnable stream without a dataset."""

    def __init__(
        self,
        *,
        vocab_size: int,
        seq_len: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        branching: int = 4,
    ) -> None:
        self.vocab_size, self.seq_len, self.batch_size = vocab_size, seq_len, batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        chain = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(vocab_size, (vocab_size, branching), generator=chain)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [batch, seq_len], for this rank at `step`."""
        shard = step * self.world_size + self.rank  # global sample index: disjoint over ranks
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + shard + 1)
        n = self.seq_len + 1
        seq = torch.empty(self.batch_size, n, dtype=torch.long)
        seq[:, 0] = torch.randint(self.vocab_size, (self.batch_size,), generator=gen)
        choice = torch.randint(self.successors.shape[1], (self.batch_size, n), generator=gen)
        for i in range(1, n):
            seq[:, i] = self.successors[seq[:, i - 1], choice[:, i]]
        return seq[:, :-1], seq[:, 1:]
