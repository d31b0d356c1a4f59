"""A tiny GPT-2 trained by a Hugging Face Trainer on CPU ranks, with meshscope's callback when
WITH_MESHSCOPE=1: prints rank 0's final weights' sum, to compare runs with and without it."""

import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

torch.manual_seed(0)
config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16)
model = GPT2LMHeadModel(config)
g = torch.Generator().manual_seed(1)
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (64, 16), generator=g)]
args = TrainingArguments(
    output_dir=os.environ["OUT_DIR"],
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    max_steps=int(os.environ.get("STEPS", "6")),
    learning_rate=1e-3,
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    use_cpu=True,
    dataloader_num_workers=0,
    seed=0,
)
trainer = Trainer(model=model, args=args, train_dataset=data)
if os.environ.get("WITH_MESHSCOPE") == "1":
    from meshscope.collector.hf import MeshscopeCallback

    trainer.add_callback(MeshscopeCallback(trainer, run_dir=os.environ["RUN_DIR"], metrics_port=None))
trainer.train()
if trainer.args.process_index == 0:
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
