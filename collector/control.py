"""The control plane: every collective meshscope issues outside DDP goes through here.

One rule. Gradients and model tensors travel on the default process group (nccl, hccl or gloo)
as device tensors; everything meshscope itself agrees on (rounds, stop flags, expert counts,
control values) goes through a `ControlPlane`:

- a **host tensor** travels on a gloo side group of its own, made once when the plane is
  built; never on the default group, even a gloo one: meshscope's traffic then never
  interleaves with the job's collectives, so a rank that skips one of the job's collectives
  leaves meshscope's sequence intact, and the flight log tells the two apart;
- a **device tensor** travels on the default group;
- the Monitor's service thread has a gloo group of its own (`service_group`) for the sums it
  issues off the training thread: two threads issuing on one group could order them
  differently on different ranks.

A host tensor never reaches an accelerator's group (nccl/hccl take device tensors only: "No
backend type associated with device type cpu"); a tensor no group of ours can carry raises
`ControlPlaneError` naming the operation, before anything is sent.

Building a plane is collective (the side group is a `new_group`): every rank builds it at the
same point, after `init_process_group`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from meshscope.collector.flightfixed import start_sum


class ControlPlaneError(RuntimeError):
    """A tensor was handed to the control plane that no group of ours can carry."""


def _device_types(group: Any) -> set[str]:
    """Device types a process group's backends accept ("cpu", "cuda", ...)."""
    types = getattr(group, "_device_types", None)
    if types is not None:
        return {d.type for d in types}
    backend = dist.get_backend(group)  # older torch: infer from the backend's name
    return {"cpu", "cuda"} if backend == "gloo" else {"cuda" if backend == "nccl" else "npu"}


class ControlPlane:
    """Routes meshscope's own collectives by where their tensors live (see the module doc)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group if group is not None else dist.distributed_c10d._get_default_group()
        self.device_types = _device_types(self.group)
        # new_group is collective: made here, on every rank, or never.
        self.host_group = dist.new_group(backend="gloo")
        # the Monitor's service thread sums host expert load here (`collector.expert_counts`):
        # a group no other thread issues on keeps every rank's sequence in one order
        self.service_group = dist.new_group(backend="gloo")

    @classmethod
    def maybe(cls) -> ControlPlane | None:
        """A plane over the default group when torch.distributed is up, else None (one rank)."""
        if dist.is_available() and dist.is_initialized():
            return cls()
        return None

    def group_for(self, tensor: torch.Tensor, op: str) -> Any:
        """The group that carries `tensor`; ControlPlaneError when none does."""
        if tensor.device.type == "cpu":
            return self.host_group
        if tensor.device.type not in self.device_types:
            raise ControlPlaneError(
                f"control plane {op}: a {tensor.device.type} tensor cannot travel on the default "
                f"group ({dist.get_backend(self.group)} takes {sorted(self.device_types)})"
            )
        return self.group

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, async_op: bool = False) -> Any:
        """All-reduce in place on the group that fits; a Work handle when `async_op`."""
        return dist.all_reduce(tensor, op=op, group=self.group_for(tensor, "all_reduce"), async_op=async_op)

    def start_sum(self, tensor: torch.Tensor, site: str) -> Any:
        """Sum `tensor` over ranks in place without waiting (a Work): a sum meshscope issues
        every window from `site`, cheaper than `all_reduce` (`collector.flightfixed.start_sum`)."""
        return start_sum(self.group_for(tensor, "all_reduce"), tensor, site)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Any:
        """Broadcast from global rank `src` in place."""
        return dist.broadcast(tensor, src=src, group=self.group_for(tensor, "broadcast"), async_op=async_op)

    def barrier(self) -> None:
        """Wait for every rank on the host group (no device work is queued by it)."""
        dist.barrier(group=self.host_group)

    def agree_max(self, value: float) -> float:
        """The largest `value` over ranks, through a host tensor (no device sync)."""
        t = torch.tensor([float(value)], dtype=torch.float64)
        self.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0])

    def agree_all(self, ok: bool) -> bool:
        """Whether every rank is `ok`, through a host tensor (a job-wide all-or-nothing)."""
        return self.agree_max(0.0 if ok else 1.0) == 0.0

    def broadcast_int(self, value: int, src: int = 0) -> int:
        """Rank `src`'s integer on every rank, through a host tensor."""
        t = torch.tensor([int(value)], dtype=torch.int64)
        self.broadcast(t, src=src)
        return int(t[0])


class LateFlag:
    """A flag agreed over ranks one round late, without blocking the round that raises it.

    Each `exchange(local)` starts a non-blocking MAX all-reduce of this round's flag and returns
    the previous round's agreed value (False on the first round). Every rank calls it once per
    round, so all ranks read the same value at the same round: a stop requested at step s is
    acted on by every rank after step s + 1."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self._pending: tuple[torch.Tensor, Any] | None = None

    def exchange(self, local: bool) -> bool:
        """Offer this rank's flag; returns the agreed value of the previous exchange."""
        agreed = self.settle()
        t = torch.tensor([1.0 if local else 0.0])
        self._pending = (t, self.plane.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True))
        return agreed

    def settle(self) -> bool:
        """Wait for the exchange in flight (host work only) and return its value."""
        if self._pending is None:
            return False
        t, work = self._pending
        self._pending = None
        work.wait()
        return bool(t[0] > 0)
