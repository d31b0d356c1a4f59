"""Subprocess for the kill-during-write test: saves checkpoints of a large model forever."""

import sys
from pathlib import Path

import torch

from meshscope.trainer.checkpoint import CheckpointManager


def main(root: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])  # ~50 MB
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = CheckpointManager(Path(root), rank=0, world_size=1, keep=2, async_save=False)
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        mgr.save(step, model, opt, {"rng": torch.get_rng_state(), "step": step})
        print(f"saved {step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
