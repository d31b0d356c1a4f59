"""The training loop. It reads like the algorithm; measurement goes through the Monitor.

The step never waits for the device: inputs go up from pinned memory without blocking, a
non-finite update is skipped by the fused optimizer reading a device flag (`found_inf`, as AMP
does), and the stop agreement is read a step late on the host (`ElasticRun.agreed_stop`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from meshscope.collector import Monitor
from meshscope.collector.flightlog import allreduce_hook as flight_allreduce_hook
from meshscope.trainer.comm import NO_OVERLAP_BUCKET_MB, HookSpec, build_hook
from meshscope.trainer.config import TrainerConfig
from meshscope.trainer.controls import ControlApplier
from meshscope.trainer.data import SyntheticTokens
from meshscope.trainer.device import Device
from meshscope.trainer.elastic import ElasticRun
from meshscope.trainer.experts import EXCHANGE_KIND, ExpertGradSync, expert_mesh, grad_norm, shard_experts
from meshscope.trainer.hierarchy import (
    hierarchical_hook,
    hierarchical_wire_bytes,
    inter_node_bytes,
    node_groups,
)
from meshscope.trainer.inject import Injector
from meshscope.trainer.model import MoELM
from meshscope.trainer.onebit_adam import OneBitAdam
from meshscope.trainer.wirefaults import collective_fault_hook, delayed_hook

# Devices whose AdamW has fused kernels that honour `found_inf`. Ascend is left out until
# torch_npu's fused AdamW is checked on hardware; it reads the norm instead (a sync point).
FUSED_DEVICES = ("cuda", "cpu", "sim")


@dataclass
class TrainState:
    """Everything one rank's training loop carries from step to step."""

    model: torch.nn.Module
    ddp: torch.nn.Module
    optimizer: torch.optim.Optimizer
    data: SyntheticTokens
    hook_state: Any
    step: int = 0
    tracer: Any = None  # tracer.TensorTracer when tracing is on
    inspector: Any = None  # tracer.GradientInspector, on rank 0
    experts: ExpertGradSync | None = None  # expert parallelism: expert gradients over replicas
    applier: Any = None  # trainer.controls.ControlApplier: its values in force are checkpointed


def gradient_hook(cfg: TrainerConfig, device: Device, mon: Monitor) -> HookSpec:
    """How DDP reduces gradients: a compression hook, or the hierarchical all-reduce with node
    groups from the topology (nproc ranks per node), its hops timed by the Monitor."""
    if cfg.train.hierarchical:
        groups = node_groups(cfg.nproc, cfg.train.compression, device.torch_device.type)
        groups.meter = mon.meter  # each hop timed: intra- and inter-node apart
        return HookSpec("hierarchical", hierarchical_hook, groups, hierarchical_wire_bytes, inter_node_bytes)
    warmup = cfg.train.compression_warmup
    if cfg.train.compression == "onebit_adam" and not warmup:
        warmup = max(1, cfg.train.steps // 10)  # Adam learns its variance before it is frozen
    return build_hook(
        cfg.train.compression,
        powersgd_rank=cfg.train.powersgd_rank,
        seed=cfg.train.seed,
        warmup_steps=warmup,
    )


def build(
    cfg: TrainerConfig,
    device: Device,
    mon: Monitor,
    *,
    rank: int,
    world_size: int,
    injector: Injector | None = None,
) -> TrainState:
    """Model, DDP with the chosen hook (registered through the Monitor), optimizer and data."""
    torch.manual_seed(cfg.train.seed)  # same init on every rank; DDP also broadcasts it
    model = MoELM(cfg.model).to(device.torch_device)
    experts = _shard_experts(cfg, model, mon) if cfg.parallel.ep > 1 else None  # before DDP
    if injector is not None:
        injector.arm(model)
    if world_size > 1:
        bucket_mb = cfg.train.bucket_cap_mb if cfg.train.overlap else NO_OVERLAP_BUCKET_MB
        ddp = DDP(
            model,
            device_ids=None if device.on_host else [device.index],
            bucket_cap_mb=bucket_mb,
            gradient_as_bucket_view=True,
        )
        spec = gradient_hook(cfg, device, mon)
        if cfg.train.compression == "onebit":  # its memories kept per parameter: a resume is exact
            spec.state.name_parameters(model)
        hook = spec.hook
        if injector is not None and any(i.kind == "comm_delay" for i in injector.mine):
            hook = delayed_hook(hook or flight_allreduce_hook, injector)
        if injector is not None and injector.touches_collectives:
            hook = collective_fault_hook(hook or flight_allreduce_hook, injector)
        mon.watch(
            ddp,
            comm_hook=hook,
            hook_state=spec.state,
            wire_bytes=spec.wire_bytes,
            inter_bytes=spec.inter_bytes,
        )
        hook_state = spec.state
    else:
        ddp, hook_state = model, None
        mon.watch(model)
    if cfg.train.compression == "onebit_adam" and hook_state is not None:  # it sends the momentum
        optimizer: torch.optim.Optimizer = OneBitAdam(
            model.parameters(), hook_state, lr=cfg.train.lr, count=mon.meter.count
        )
    else:
        optimizer = build_optimizer(model, cfg, device)
    data = SyntheticTokens(
        vocab_size=cfg.model.vocab_size,
        seq_len=cfg.model.seq_len,
        batch_size=cfg.train.batch_size,
        seed=cfg.train.seed,
        rank=rank,
        world_size=world_size,
    )
    return TrainState(
        model=model, ddp=ddp, optimizer=optimizer, data=data, hook_state=hook_state, experts=experts
    )


def _shard_experts(cfg: TrainerConfig, model: torch.nn.Module, mon: Monitor) -> ExpertGradSync:
    """Expert parallelism: keep this rank's experts, time and count their exchanges, and keep
    them out of DDP (it must neither broadcast nor reduce them: their replicas do)."""
    mesh = expert_mesh(cfg.parallel.ep)
    mesh.dropless = cfg.parallel.dispatch == "dropless"
    mesh.timer = lambda: mon.meter.hop(EXCHANGE_KIND)
    mesh.count = mon.meter.count_exchange
    DDP._set_params_and_buffers_to_ignore_for_model(model, shard_experts(model, mesh))
    return ExpertGradSync.attach(model, mesh)


def train_step(
    state: TrainState, mon: Monitor, cfg: TrainerConfig, device: Device, injector: Injector
) -> None:
    """One optimizer step in named phases: forward, backward, optimizer."""
    tokens = cfg.train.batch_size * cfg.model.seq_len
    injector.before_step(state.step, state.model)
    if state.tracer is not None:
        state.tracer.step_begin(state.step)
    started = time.perf_counter()
    with mon.step(tokens=tokens, step=state.step) as s:
        with s.phase("data"):
            inputs, targets = map(device.upload, state.data.batch(state.step))
        with s.phase("forward"):
            injector.slow_down(state.step)
            logits = state.ddp(inputs)
            loss, lm_loss = state.model.loss(logits, targets)
            loss = injector.poison_loss(loss, state.step)
            lm_loss = injector.poison_loss(lm_loss, state.step)
        with s.phase("backward"):
            loss.backward()
        with s.phase("optimizer"):
            if state.inspector is not None:
                if state.experts is not None:  # measured reduced, as clipping reads them
                    state.experts.wait()
                state.inspector.before_clip(state.step)
            grad_norm = clip_gradients(state, cfg.train.grad_clip)
            step_if_finite(state.optimizer, grad_norm, agree=own_gradients(state.optimizer))
            if state.inspector is not None:
                state.inspector.after_update()
            state.optimizer.zero_grad(set_to_none=False)
        s.log(loss=lm_loss, grad_norm=grad_norm)
    if state.tracer is not None:
        step = state.step

        def rerun() -> torch.Tensor:  # the bare model: no DDP, no collective
            injector.replay(step, state.model)  # a late re-run meets the step's own faults
            loss, _ = state.model.loss(state.model(inputs), targets)
            return injector.poison_loss(loss, step)

        if state.experts is not None:  # a re-run would exchange tokens with peers not re-running
            state.tracer.no_rerun = "not localised under expert parallelism (a re-run needs every EP peer)"
        state.tracer.step_end(loss=loss, grad_norm=grad_norm, rerun=rerun if state.experts is None else None)
    injector.step_took(state.step, time.perf_counter() - started)
    state.step += 1


def own_gradients(optimizer: torch.optim.Optimizer) -> Any:
    """The group over which ranks step on gradients of their own (1-bit Adam's), else None."""
    if not isinstance(optimizer, OneBitAdam):
        return None
    return optimizer.onebit.process_group or dist.group.WORLD  # its None is the default group


def clip_gradients(state: TrainState, max_norm: float) -> torch.Tensor:
    """Clip to `max_norm` by the whole model's gradient norm (returned); under expert
    parallelism once the expert gradients are reduced, with the norm every rank shares."""
    if state.experts is None:
        return torch.nn.utils.clip_grad_norm_(state.model.parameters(), max_norm)
    state.experts.wait()
    norm = grad_norm(state.model, state.experts.mesh)
    torch.nn.utils.clip_grads_with_norm_(state.model.parameters(), max_norm, norm)
    return norm


def build_optimizer(model: torch.nn.Module, cfg: TrainerConfig, device: Device) -> torch.optim.Optimizer:
    """AdamW, fused where torch has fused kernels for the device: they can skip a step on a
    device flag, which the plain implementation cannot."""
    fused = device.kind in FUSED_DEVICES
    return torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=0.0, fused=fused or None)


def step_if_finite(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor, agree: Any = None) -> None:
    """Apply the update unless the gradients are not finite: one NaN must not poison weights.

    Fused AdamW reads `found_inf` on the device and leaves weights, moments and its step count
    untouched when it is 1: no sync. Elsewhere the norm is read on the host. `agree`: the group
    whose ranks must decide alike although their norms differ (1-bit Adam reduces no gradient,
    and its step is a collective: a rank skipping alone would pair its peers' momentum
    all-reduces across steps, then hang them)."""
    if agree is not None:
        grad_norm = agreed_norm(grad_norm, agree)
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = (~torch.isfinite(grad_norm)).to(torch.float32)
        optimizer.step()
    elif bool(torch.isfinite(grad_norm)):  # sync point: optimizers without device-side skipping
        optimizer.step()


def agreed_norm(grad_norm: torch.Tensor, group: Any) -> torch.Tensor:
    """The norm, NaN on every rank of `group` where it is not finite on any (on the device)."""
    bad = (~torch.isfinite(grad_norm)).to(torch.float32).reshape(1)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    return torch.where(bad[0] > 0, torch.full_like(grad_norm, float("nan")), grad_norm)


def train(
    state: TrainState,
    mon: Monitor,
    cfg: TrainerConfig,
    device: Device,
    elastic: ElasticRun | None = None,
    injector: Injector | None = None,
    applier: ControlApplier | None = None,
) -> str:
    """Run to `train.steps`; returns "done", or "sigterm" when asked to stop."""
    injector = injector or Injector([], 0, lambda inj, step: None)
    while state.step < cfg.train.steps:
        train_step(state, mon, cfg, device, injector)
        if applier is not None:  # approved changes land between steps, on every rank at once
            applier.at_boundary(state.step - 1)
        if elastic is None:
            continue
        elastic.after_step(state)
        if elastic.agreed_stop():
            return "sigterm"
        if elastic.should_checkpoint(state.step):
            elastic.checkpoint(state)
    return "done"
