"""1-bit Adam (Tang et al., 2021; DeepSpeed's OnebitAdam): Adam whose communication is 1 bit per
value once its variance has settled.

Warm-up (the first `freeze_step` steps): gradients are all-reduced in full precision by DDP's
hook and Adam runs as usual, learning the variance v. Compression stage: v is frozen; DDP's
hook sends nothing (each rank keeps its own gradient); each rank updates its momentum
m = β1·m + (1−β1)·g with its local gradient, and the momenta are averaged over the ranks by the
two-phase 1-bit all-reduce with error feedback (`onebit.onebit_allreduce`: sign bits and a scale
per block, each rank's and each chunk-owner's compression error carried to the next step). Every
rank then holds the same m and applies x −= lr·(m̂ / (√v̂ + ε) + wd·x), with Adam's bias
corrections: m̂ = m / (1 − β1^t), and v̂ = v / (1 − β2^T) with T the step the variance froze at.
(DeepSpeed leaves both out and relies on a learning-rate warm-up; without one, the first steps
are ~3× Adam's, and the run ends measurably worse: benchmarks/compression_loss.py.)

Momentum, not the gradient, is what is compressed: error feedback on a gradient fed to Adam's
non-linear update (dividing by √v of compressed gradients) is what loses accuracy; the frozen
v makes the update linear in m, so the compression error is compensated exactly over steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from meshscope.collector.comm import allgather_sent_bytes, allreduce_sent_bytes, alltoall_sent_bytes
from meshscope.trainer.onebit import OneBitState, message_bytes, onebit_allreduce, padded_length
from meshscope.trainer.serial import serial_hook

MOMENTUM_KEY = -1  # the error-feedback buffers of the momentum (bucket keys are >= 0)


class OneBitAdam(torch.optim.Optimizer):
    """Adam with a full-precision warm-up, then frozen variance and 1-bit momentum (module doc)."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        onebit: OneBitState,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        count: Callable[[int, int], None] | None = None,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.onebit = onebit  # shared with the DDP hook: its step count says the stage
        self.count = count  # (raw, wire) bytes of the momentum all-reduce, for the Monitor

    @property
    def compressing(self) -> bool:
        """Past the warm-up: the variance is frozen and the momentum travels as 1 bit."""
        return self.onebit.iter > self.onebit.warmup_steps

    def _with_grads(self) -> list[tuple[dict[str, Any], torch.nn.Parameter]]:
        """(its group, parameter) of every parameter that has a gradient this step."""
        return [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One update (see the module doc); collective in the compression stage."""
        todo = self._with_grads()
        if not todo:
            return
        frozen = self.compressing
        for group, p in todo:
            beta1, beta2 = group["betas"]
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["frozen_at"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1  # host tensors: counts, not device values
            state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
            if not frozen:
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                state["frozen_at"].copy_(state["step"])
        if frozen:
            self._average_momentum([p for _, p in todo])
        for group, p in todo:
            beta1, beta2 = group["betas"]
            state = self.state[p]
            first = 1 - beta1 ** float(state["step"])  # host tensor
            second = 1 - beta2 ** float(state["frozen_at"])  # host tensor
            denom = (state["exp_avg_sq"] / second).sqrt_().add_(group["eps"])
            update = (state["exp_avg"] / first).div_(denom)
            if group["weight_decay"]:
                update.add_(p, alpha=group["weight_decay"])
            p.add_(update, alpha=-group["lr"])

    def _average_momentum(self, params: list[torch.nn.Parameter]) -> None:
        """Every rank's momentum averaged by the 1-bit all-reduce (one flat buffer)."""
        momenta = [self.state[p]["exp_avg"] for p in params]
        flat = torch.cat([m.reshape(-1) for m in momenta])
        onebit_allreduce(self.onebit, flat, MOMENTUM_KEY)
        if self.count is not None:
            world = dist.get_world_size(self.onebit.process_group)
            self.count(0, momentum_wire_bytes(flat.numel(), world, self.onebit.block_size))
        offset = 0
        for m in momenta:
            m.copy_(flat[offset : offset + m.numel()].view_as(m))
            offset += m.numel()


def momentum_wire_bytes(n: int, world: int, block: int) -> int:
    """Bytes a rank sends to average `n` momentum values 1-bit: the all-to-all, then the gather."""
    chunk = padded_length(n, world, block) // world
    row = message_bytes(chunk, block)
    return alltoall_sent_bytes(row * world, world) + allgather_sent_bytes(row, world)


def _bucket(state: OneBitState, bucket: dist.GradBucket) -> torch.Tensor:
    """Warm-up: the bucket averaged in full precision; then the rank's own gradient, unsent."""
    grad = bucket.buffer()
    if state.iter < state.warmup_steps:
        dist.all_reduce(grad, group=state.process_group)
        grad.div_(dist.get_world_size(state.process_group))
    if bucket.is_last():
        state.iter += 1
    return grad


# DDP's comm hook for 1-bit Adam: buckets in DDP's order on one thread
onebit_adam_hook = serial_hook(_bucket, "onebit-adam")


def onebit_adam_wire_bytes(state: OneBitState, bucket: dist.GradBucket, world_size: int) -> int:
    """Bytes the hook sends for one bucket: all of it while warming up, none after (the
    optimizer counts the momentum it sends instead)."""
    if state is not None and state.iter < state.warmup_steps:
        return allreduce_sent_bytes(bucket.buffer().numel() * bucket.buffer().element_size(), world_size)
    return 0
