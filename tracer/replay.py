"""Replay: re-run a snapshot's module on the CPU and see whether the non-finite value returns.

The caller rebuilds the module (the CLI does it from the run's config); replay loads the
snapshot's parameters into it, restores the RNG state, and calls it with the stored inputs:
forward for a forward finding; forward then backward with the stored output gradient for a
backward one. Reproduced means the same kind of tensor comes out non-finite again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshscope.tracer.snapshot import Snapshot, SnapshotError, snapshot_args


@dataclass
class ReplayResult:
    """What the re-run gave."""

    reproduced: bool
    nonfinite: list[str]
    message: str


def _nonfinite(name: str, values: object) -> list[str]:
    tensors = (
        [values]
        if isinstance(values, torch.Tensor)
        else [v for v in (values if isinstance(values, (list, tuple)) else []) if isinstance(v, torch.Tensor)]
    )
    return [
        f"{name}.{i}"
        for i, t in enumerate(tensors)
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]


def load_into(module: torch.nn.Module, snap: Snapshot) -> None:
    """The snapshot's parameters into `module` (names and shapes must match)."""
    params = dict(module.named_parameters(recurse=True))
    stored = snap.params()
    missing = sorted(set(params) - set(stored))
    if missing:
        raise SnapshotError(f"{snap.path}: no values for parameters {missing[:5]} of {snap.meta.module}")
    with torch.no_grad():
        for name, p in params.items():
            if p.shape != stored[name].shape:
                raise SnapshotError(
                    f"{snap.path}: parameter {name} has shape "
                    f"{tuple(stored[name].shape)}, the module {tuple(p.shape)}"
                )
            p.copy_(stored[name])


def replay(snap: Snapshot, module: torch.nn.Module) -> ReplayResult:
    """Re-run `module` (already built, on the CPU) on the snapshot."""
    load_into(module, snap)
    if "rng.cpu" in snap.tensors:
        torch.set_rng_state(snap.tensors["rng.cpu"])
    module.train()
    args = snapshot_args(snap)
    if snap.meta.where == "forward":
        with torch.no_grad():
            out = module(*args)
        bad = _nonfinite("output", out)
        return ReplayResult(
            bool(bad),
            bad,
            "forward output non-finite again"
            if bad
            else "forward output finite: the fault is not in this module's "
            "inputs and parameters (a hook, a kernel, or the device)",
        )
    inputs = [
        a.clone().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        for a in args
    ]
    out = module(*inputs)
    outs = [
        o
        for o in (out if isinstance(out, (tuple, list)) else [out])
        if isinstance(o, torch.Tensor) and o.requires_grad
    ]
    grads = snap.group("grad_output")[: len(outs)]
    if len(grads) != len(outs):
        return ReplayResult(False, [], "the snapshot has no output gradient to replay with")
    torch.autograd.backward(outs, grads)
    grads_in = [a.grad for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
    grads_in += [p.grad for p in module.parameters() if p.grad is not None]
    bad = _nonfinite("grad_input", grads_in)
    return ReplayResult(
        bool(bad),
        bad,
        "backward gradient non-finite again"
        if bad
        else "backward gradients finite: the fault was not this module's backward "
        "for these inputs (a hook, a kernel, or the device)",
    )
