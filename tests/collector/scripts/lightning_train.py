"""A tiny token model trained by Lightning's DDP strategy on CPU ranks, with meshscope's callback
when WITH_MESHSCOPE=1: prints rank 0's final weights' sum, to compare runs with and without it."""

import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.head = torch.nn.Linear(32, 64)

    def training_step(self, batch, batch_idx):
        logits = self.head(self.embed(batch[:, :-1]))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 64), batch[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
model = Tiny()
data = DataLoader(torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(1)), batch_size=4)
callbacks = []
if os.environ.get("WITH_MESHSCOPE") == "1":
    from meshscope.collector.lightning import MeshscopeCallback

    callbacks.append(MeshscopeCallback(run_dir=os.environ["RUN_DIR"], metrics_port=None))
trainer = L.Trainer(
    accelerator="cpu",
    devices=2,
    strategy="ddp",
    max_steps=int(os.environ.get("STEPS", "6")),
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    callbacks=callbacks,
)
trainer.fit(model, data)
if trainer.global_rank == 0:
    print("WEIGHTS", float(sum(p.detach().double().sum() for p in model.parameters())))
# As PyTorch's docs ask at the end of a script. DDP's reducer still holds the group after this,
# so gloo's worker threads live on into interpreter teardown, where freeing a finished work's
# tensors aborts the process ("terminate called without an active exception", about one run in
# 40, with or without meshscope): leave without that teardown, as the `meshscope` command does.
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
