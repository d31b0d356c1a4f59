"""Functions run on every rank by fixtures/dist.run_ranks (module level, for spawn)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from meshscope.collector import Monitor, MonitorConfig
from meshscope.collector.env import DistEnv
from meshscope.collector.store import load_steps
from meshscope.trainer.comm import build_hook
from meshscope.trainer.onebit import OneBitState, onebit_hook


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))


def _inputs(rank: int, batch: int) -> torch.Tensor:
    return torch.randn(batch, 32, generator=torch.Generator().manual_seed(100 + rank))


def _reference_grads(model: torch.nn.Module, x: torch.Tensor, world: int) -> list[torch.Tensor]:
    local = copy.deepcopy(model)
    local(x).pow(2).sum().backward()
    grads = [p.grad.clone() for p in local.parameters()]
    for g in grads:
        dist.all_reduce(g)
        g /= world
    return grads


def _relative_error(grads: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max(float((g - r).norm() / r.norm()) for g, r in zip(grads, ref))


def hook_agreement(rank: int, world_size: int, run_dir: str, steps: int = 48) -> dict:
    """Per hook: the DDP-averaged gradient against the exact mean, and the bytes the meter saw."""
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size)
    base = _mlp()
    x = _inputs(rank, batch=1)  # batch 1 per rank: gradient matrices of rank <= world size
    ref = _reference_grads(base, x, world_size)
    out: dict = {}
    for name in ("none", "fp16", "powersgd", "onebit"):
        # timed every step, as meshscope run times them: these cases check each step's wait
        config = MonitorConfig(run_dir=f"{run_dir}/{name}", metrics_port=None, detail_every=1)
        mon = Monitor(config, env=env)
        ddp = DDP(copy.deepcopy(base), bucket_cap_mb=1)
        spec = build_hook(name, powersgd_rank=world_size)
        mon.watch(ddp, comm_hook=spec.hook, hook_state=spec.state, wire_bytes=spec.wire_bytes)
        errors, mean_grads, early = [], None, None
        for step in range(steps):
            ddp.zero_grad()
            with mon.step():
                ddp(x).pow(2).sum().backward()
            grads = [p.grad.clone() for p in ddp.parameters()]
            mean_grads = grads if mean_grads is None else [m + g for m, g in zip(mean_grads, grads)]
            errors.append(max(float((g - r).norm() / r.norm()) for g, r in zip(grads, ref)))
            if step + 1 == steps // 4:
                early = _relative_error([m / (step + 1) for m in mean_grads], ref)
        mon.close()
        steps_df = load_steps(f"{run_dir}/{name}")  # both ranks write here: keep this rank's
        steps_df = steps_df[steps_df["rank"] == rank].sort_values("step")
        mean_grads = [m / steps for m in mean_grads]
        out[name] = {
            "last_error": errors[-1],
            "mean_error": _relative_error(mean_grads, ref),
            "mean_error_early": early,
            "bytes_raw": steps_df["bytes_raw"].tolist(),
            "bytes_wire": steps_df["bytes_wire"].tolist(),
            "comm_total_s": steps_df["comm_total_s"].tolist(),
            "comm_exposed_s": steps_df["comm_exposed_s"].tolist(),
        }
    return out


def convex_problem(rank: int, world_size: int, steps: int = 600, lr: float = 0.05) -> dict:
    """Least squares, full-batch per rank: final global loss for SGD with each hook."""
    gen = torch.Generator().manual_seed(7)
    w_true = torch.randn(64, 1, generator=gen)
    local = torch.Generator().manual_seed(1000 + rank)
    X = torch.randn(256, 64, generator=local)
    y = X @ w_true + 0.1 * torch.randn(256, 1, generator=local)
    results = {}
    variants = {"sgd": None, "onebit_ef": True, "onebit_no_ef": False}
    for name, feedback in variants.items():
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(64, 1, bias=False))
        if feedback is not None:
            model.register_comm_hook(OneBitState(error_feedback=feedback), onebit_hook)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for _ in range(steps):
            opt.zero_grad()
            ((model(X) - y) ** 2).mean().backward()
            opt.step()
        with torch.no_grad():
            loss = ((model.module(X) - y) ** 2).mean().reshape(1)
        dist.all_reduce(loss)
        results[name] = float(loss) / world_size
    return results


def onebit_across_buckets(rank: int, world_size: int, steps: int = 6) -> dict:
    """The MLP trained with the 1-bit hook three ways: one bucket for everything; a bucket per
    layer; and that run restarted half-way in a new DDP (its first iteration on one bucket
    again) from the hook's saved state. Final weights and the saved memories of each."""
    import io

    def train(cap_mb: float, state: OneBitState, model: torch.nn.Module, first: int, last: int) -> None:
        ddp = DDP(model, bucket_cap_mb=cap_mb, gradient_as_bucket_view=True)
        state.name_parameters(model)
        ddp.register_comm_hook(state, onebit_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(first, last):
            opt.zero_grad()
            ddp(_inputs(rank + 10 * step, 16)).pow(2).sum().backward()
            opt.step()

    out = {}
    for name, cap in (("one bucket", 1.0), ("bucket per layer", 0.0005)):
        model, state = _mlp(), OneBitState()
        train(cap, state, model, 0, steps)
        out[name] = ([p.detach().clone() for p in model.parameters()], state.state_dict()["params"])
    model, state = _mlp(), OneBitState()
    train(0.0005, state, model, 0, steps // 2)
    saved = io.BytesIO()
    torch.save({"hook": state.state_dict(), "model": model.state_dict()}, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=True)  # as a checkpoint is read back
    model, state = _mlp(), OneBitState()
    model.load_state_dict(loaded["model"])
    state.load_state_dict(loaded["hook"])
    train(0.0005, state, model, steps // 2, steps)
    out["restarted"] = ([p.detach().clone() for p in model.parameters()], state.state_dict()["params"])
    return out
