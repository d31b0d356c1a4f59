"""Expert parallelism: each MoE layer's experts sharded over an expert-parallel (EP) group.

The world is a 2-D device mesh, data × expert (`dp` × `ep`, rank = i·ep + j). The ranks of one
row (one data shard's EP group) hold one copy of every expert between them, E/ep each, in
order: rank j of the row holds experts j·E/ep … (j+1)·E/ep − 1. A column holds replicas of the
same experts (their `replicas` group). EP groups never cross a node (ep divides the ranks per
node), so the all-to-all stays on the fast links inside a node, as large MoE jobs place it.

A step, per MoE layer: each rank routes its own tokens as before, into a slot table of static
capacity per expert ([E, C, d]); one `all_to_all_single` over the EP group sends each expert's
slots to the rank that holds it, that rank runs its E/ep experts over every sender's slots at
once ([E/ep, ep·C, d]), and a second all-to-all sends the results back. Every split is even
and comes from the configuration, so the host never reads a device value. Backward runs the
same two exchanges in reverse. Each exchange is timed through the Monitor's meter
(`expert_all_to_all`), so a slow link between EP peers is seen as all-to-all time.

Gradients: DDP reduces the dense parameters over the whole world (with the chosen compression
hook); expert parameters are left out of DDP and reduced over their replicas only, each layer's
as soon as backward has produced it (`ExpertGradSync`). The objective is the world's mean loss,
so an expert's gradient (the sum of what its EP row sent back through the exchange) is summed
over the replicas and divided by the world size. The gradient norm for clipping is the norm of
the whole model: the expert part is summed over the EP group, so every rank clips alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from meshscope.collector.moe import ExchangeSide

EXCHANGE_KIND = "expert_all_to_all"  # the meter's kind for the dispatch and combine exchanges


@dataclass
class ExpertMesh:
    """This rank's place on the data × expert mesh, and the groups it talks to."""

    ep: int
    dp: int
    ep_rank: int
    ep_group: Any
    replicas: Any  # the ranks holding the same experts (one per data shard)
    dropless: bool = False  # uneven splits, every token (see `dropless_dispatch`)
    rows_on_host: Any = None  # the EP rows as gloo groups: checkpoints shard experts over them
    timer: Callable[[], Any] | None = None  # a context manager timing one exchange (the Monitor's)
    count: Callable[[int], None] | None = None  # the bytes one exchange sent (the Monitor's)
    miscount: Callable[[list[int]], list[int]] | None = None  # fault injection: a router's wrong splits
    skip: Callable[[], bool] | None = None  # fault injection: this rank leaves this exchange out
    mid_move: Callable[[], None] | None = None  # fault injection: inside a re-placement, before agreeing
    # told each exchange as this rank's experts see it: what it sends (before), then what
    # arrived (after), one of them None (the tensor tracer, which places a NaN by it:
    # `collector.moe.ExchangeSide`)
    watch: Callable[[ExchangeSide, torch.Tensor | None, torch.Tensor | None], None] | None = None

    @property
    def world(self) -> int:
        """Ranks in the job."""
        return self.dp * self.ep

    def local_experts(self, experts: int) -> range:
        """The global indices of the experts this rank holds (of `experts` per layer)."""
        per = experts // self.ep
        return range(self.ep_rank * per, (self.ep_rank + 1) * per)


def expert_mesh(ep: int) -> ExpertMesh:
    """The data × expert mesh over the whole world, its rows and columns as process groups of
    the job's backend (collective: every rank calls it at the same point)."""
    world = dist.get_world_size()
    if ep < 1 or world % ep:
        raise ValueError(f"parallel.ep: {world} ranks do not split into expert groups of {ep}")
    dp = world // ep
    rows = [list(range(i * ep, (i + 1) * ep)) for i in range(dp)]
    row, _ = dist.new_subgroups_by_enumeration(rows)
    column, _ = dist.new_subgroups_by_enumeration([list(range(j, world, ep)) for j in range(ep)])
    on_host, _ = dist.new_subgroups_by_enumeration(rows, backend="gloo")
    return ExpertMesh(
        ep=ep, dp=dp, ep_rank=dist.get_rank() % ep, ep_group=row, replicas=column, rows_on_host=on_host
    )


Sides = tuple[ExchangeSide | None, ExchangeSide | None]  # an exchange's (forward, backward) sides
UNWATCHED: Sides = (None, None)


def sides(mesh: ExpertMesh, experts: Any, dispatch: bool, runs: Callable[[], list[tuple[int, int]]]) -> Sides:
    """How the mesh's watcher sees one exchange, forward and backward: a dispatch feeds this
    rank's experts, and its gradient leaves them; a combine the other way round. `runs`: the
    rows of what leaves, (local expert, rows) in order, computed only for a watcher."""
    if mesh.watch is None:
        return UNWATCHED
    rows = tuple(runs())
    return (
        ExchangeSide(experts, "forward", dispatch, () if dispatch else rows),
        ExchangeSide(experts, "backward", not dispatch, rows if dispatch else ()),
    )


class _Exchange(torch.autograd.Function):
    """An even all-to-all over the EP group whose gradient is the same all-to-all back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: ExpertMesh, seen: Sides) -> torch.Tensor:  # type: ignore[override]
        ctx.mesh, ctx.seen = mesh, seen
        return exchange(x, mesh, side=seen[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return exchange(grad.contiguous(), ctx.mesh, side=ctx.seen[1]), None, None


def exchange(
    x: torch.Tensor,
    mesh: ExpertMesh,
    send: list[int] | None = None,
    recv: list[int] | None = None,
    side: ExchangeSide | None = None,
) -> torch.Tensor:
    """Chunk j of `x` along dim 0 to EP rank j, chunk i of the result from rank i: even chunks,
    or `send` rows to each rank and `recv` rows from each. `side`: what the mesh's watcher is
    told of it."""
    out = torch.empty_like(x) if recv is None else x.new_empty(sum(recv), *x.shape[1:])
    if mesh.count is not None:
        row = x[0].numel() * x.element_size() if x.shape[0] else 0
        own = (send[mesh.ep_rank] if send is not None else x.shape[0] // mesh.ep) * row
        mesh.count(x.numel() * x.element_size() - own)  # what leaves this rank
    if mesh.skip is not None and mesh.skip():  # a wrong branch: its own rows stay, peers wait
        return out.copy_(x) if out.shape == x.shape else out.zero_()
    watch = mesh.watch if side is not None else None
    if watch is not None:  # what leaves, summed while it is still warm
        watch(side, x, None)
    timer = mesh.timer() if mesh.timer is not None else contextlib.nullcontext()
    with timer:
        dist.all_to_all_single(out, x, recv, send, group=mesh.ep_group)
    if watch is not None:
        watch(side, None, out)
    return out


class _SplitExchange(torch.autograd.Function):
    """An all-to-all with uneven splits over the EP group; its gradient goes back the same way
    with the splits swapped."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, mesh: ExpertMesh, send: list[int], recv: list[int], seen: Sides
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.mesh, ctx.send, ctx.recv, ctx.seen = mesh, send, recv, seen
        return exchange(x, mesh, send, recv, side=seen[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:  # type: ignore[override]
        back = exchange(grad.contiguous(), ctx.mesh, ctx.recv, ctx.send, side=ctx.seen[1])
        return back, None, None, None, None


def dropless_dispatch(
    flat: torch.Tensor,
    slot_of: torch.Tensor,
    weights: torch.Tensor,
    experts: Any,
    mesh: ExpertMesh,
    total: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every assignment to the rank holding its expert, none dropped: ([T, d] the weighted sum
    of the experts' outputs, [E/ep] tokens this rank's experts processed).

    The splits depend on the routing, so the host reads them once per layer (the counts of an
    even all-to-all), as Megatron's all-to-all token dispatcher does; each expert then computes
    its own tokens only, so a rank whose experts get more tokens computes longer. `slot_of`:
    [T, k] the slot (rank-major, see `placement.move_experts`) of each token's chosen experts."""
    tokens, d = flat.shape
    k, per = slot_of.shape[1], total // mesh.ep
    expert_of = slot_of.reshape(-1)
    order = torch.argsort(expert_of, stable=True)  # assignments grouped by slot
    counts = torch.nn.functional.one_hot(expert_of, total).sum(dim=0)  # [E], on the device
    received_counts = exchange(counts.view(mesh.ep, per).contiguous(), mesh)  # [sender, my expert]
    sent, got = torch.stack([counts, received_counts.reshape(-1)]).tolist()  # sync point: the splits
    send = [sum(sent[j * per : (j + 1) * per]) for j in range(mesh.ep)]
    if mesh.miscount is not None:
        send = mesh.miscount(send)
    recv = [sum(got[s * per : (s + 1) * per]) for s in range(mesh.ep)]

    def runs() -> list[tuple[int, int]]:  # rows from or to my experts: (sender, expert) pieces
        return [(i, got[s * per + i]) for s in range(mesh.ep) for i in range(per)]

    source = flat.repeat_interleave(k, dim=0)[order]
    arrived = _SplitExchange.apply(source, mesh, send, recv, sides(mesh, experts, True, runs))
    pieces = arrived.split(got)  # (sender, expert) pieces, sender-major
    outputs = [experts.one(i, torch.cat([pieces[s * per + i] for s in range(mesh.ep)])) for i in range(per)]
    by_sender = [out.split([got[s * per + i] for s in range(mesh.ep)]) for i, out in enumerate(outputs)]
    back = torch.cat([by_sender[i][s] for s in range(mesh.ep) for i in range(per)])
    returned = _SplitExchange.apply(back, mesh, recv, send, sides(mesh, experts, False, runs))  # sorted order
    unsorted = torch.empty_like(returned).index_copy(0, order, returned)
    out = (unsorted * weights.reshape(-1, 1)).view(tokens, k, d).sum(dim=1)
    # tokens each of my experts took, summed on the device (a tensor from the host's list
    # would be a blocking host-to-device copy every step)
    return out, received_counts.reshape(mesh.ep, per).sum(dim=0).to(torch.float32)


def dispatch_and_combine(
    slots: torch.Tensor, experts: Callable[[torch.Tensor], torch.Tensor], mesh: ExpertMesh
) -> tuple[torch.Tensor, torch.Tensor]:
    """slots: [E, C, d+1], each expert's slot table with a last column of 1 where a token sits.
    Returns ([E, C, d] the experts' outputs back in the sender's slots, [E/ep] tokens this
    rank's experts processed)."""
    e, cap, width = slots.shape
    per = e // mesh.ep

    def runs() -> list[tuple[int, int]]:  # one row per (sender, expert) slot table
        return [(i, 1) for _ in range(mesh.ep) for i in range(per)]

    received = _Exchange.apply(slots, mesh, sides(mesh, experts, True, runs)).view(mesh.ep, per, cap, width)
    mine = received.transpose(0, 1).reshape(per, mesh.ep * cap, width)
    processed = mine[..., -1].sum(dim=1)  # the filled slots of every sender: on the device
    out = experts(mine[..., :-1])  # [per, ep·C, d]
    back = out.view(per, mesh.ep, cap, width - 1).transpose(0, 1).contiguous()
    return _Exchange.apply(back, mesh, sides(mesh, experts, False, runs)).view(e, cap, width - 1), processed


def shard_experts(model: nn.Module, mesh: ExpertMesh) -> list[str]:
    """Keep this rank's experts of every MoE layer (sliced from the full, identically seeded
    initialisation, so an EP run starts from the replicated run's weights). Returns the names
    of the expert parameters (DDP leaves them out)."""
    names = []
    for layer_name, layer in _moe_layers(model):
        total = len(layer.experts)
        if total % mesh.ep:
            raise ValueError(f"parallel.ep: {total} experts per layer do not split over {mesh.ep} ranks")
        mine = mesh.local_experts(total)
        for pname, param in list(layer.experts.named_parameters(recurse=False)):
            param.data = param.data[mine.start : mine.stop].clone()
            names.append(f"{layer_name}.experts.{pname}")
        # slot s (rank s // (E/ep), its local index s % (E/ep)) holds expert slot_expert[s]: the
        # identity until a re-placement moves experts (`placement.move_experts`); saved with checkpoints
        device = layer.router.gate.weight.device
        layer.register_buffer("slot_expert", torch.arange(total, device=device))
        names.append(f"{layer_name}.slot_expert")  # agreed by every rank, never broadcast by DDP
        layer.expert_mesh = mesh
    return names


def _moe_layers(model: nn.Module) -> Iterator[tuple[str, Any]]:
    for name, module in model.named_modules():
        if hasattr(module, "expert_mesh") and hasattr(module, "experts"):
            yield name, module


def slot_order(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot -> expert, expert -> slot) of a sharded layer, on its device."""
    slots = layer.slot_expert
    return slots, torch.argsort(slots)


def expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every sharded expert parameter, in model order."""
    return [
        (f"{name}.experts.{p}", param)
        for name, layer in _moe_layers(model)
        if layer.expert_mesh is not None
        for p, param in layer.experts.named_parameters(recurse=False)
    ]


@dataclass
class ExpertGradSync:
    """Reduces each MoE layer's expert gradients over their replicas as soon as backward has
    produced them (overlapping the rest of backward), and waits for them before the optimizer."""

    mesh: ExpertMesh
    layers: list[list[nn.Parameter]]
    _ready: list[int] = field(default_factory=list)
    _works: list[Any] = field(default_factory=list)

    @classmethod
    def attach(cls, model: nn.Module, mesh: ExpertMesh) -> ExpertGradSync:
        """Hook every expert parameter of `model` (already sharded)."""
        layers = [
            list(layer.experts.parameters())
            for _, layer in _moe_layers(model)
            if layer.expert_mesh is not None
        ]
        sync = cls(mesh, layers, [0] * len(layers))
        for index, params in enumerate(layers):
            for param in params:
                param.register_post_accumulate_grad_hook(lambda _p, i=index: sync._accumulated(i))
        return sync

    def _accumulated(self, layer: int) -> None:
        self._ready[layer] += 1
        if self._ready[layer] == len(self.layers[layer]):
            self._ready[layer] = 0
            self._launch(self.layers[layer])

    def _launch(self, params: list[nn.Parameter]) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        # the world's mean: summed over the replicas of EP rows that each summed over their ranks
        if self.mesh.dp == 1:
            for g in grads:
                g.div_(self.mesh.world)
            return
        flat = _flatten_dense_tensors(grads).div_(self.mesh.world)  # one collective per layer
        self._works.append((dist.all_reduce(flat, group=self.mesh.replicas, async_op=True), flat, grads))

    def wait(self) -> None:
        """Every layer's expert gradients are reduced (call before clipping)."""
        for work, flat, grads in self._works:
            work.wait()
            for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(reduced)
        self._works.clear()


def grad_norm(model: nn.Module, mesh: ExpertMesh | None) -> torch.Tensor:
    """The L2 norm of every gradient of the model, the same on every rank: the dense part is
    replicated, the expert part summed over the EP group (a device-side all-reduce)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if mesh is None or mesh.ep == 1:
        return torch.nn.utils.get_total_norm([p.grad for p in params])
    experts = {id(p) for _, p in expert_parameters(model)}
    squares = torch.nn.utils.get_total_norm([p.grad for p in params if id(p) in experts]).pow(2)
    dist.all_reduce(squares, group=mesh.ep_group)
    # the dense part after that all-reduce: on a device every kernel is ordered after DDP's
    # reductions anyway; on the simulated one (the host is the stream) this is where they are done
    dense = torch.nn.utils.get_total_norm([p.grad for p in params if id(p) not in experts])
    return (dense.pow(2) + squares).sqrt()


class ShardedExperts:
    """Checkpoints of sharded experts: each expert parameter, and its optimizer moments, enter
    torch.distributed.checkpoint as a DTensor sharded over the EP row (dim 0, the expert), so
    DCP writes every expert once (the replicas of a column write the same shard, kept once) and
    reads back whichever shard a rank holds now, at any number of data replicas."""

    def __init__(self, model: nn.Module, mesh: ExpertMesh) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        self.names = {name for name, _ in expert_parameters(model)}
        self.mesh = DeviceMesh.from_group(mesh.rows_on_host, "cpu")

    def wrap(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> dict[str, Any]:
        """{"model", "optim"} for DCP: the expert entries as DTensors over the same storage (new
        dicts: the optimizer's own state is never touched)."""
        model = dict(model_sd)
        state = dict(optim_sd.get("state", {}))
        for name in self.names:
            model[name] = self._sharded(model_sd[name])
            if name in state:
                state[name] = {
                    key: self._sharded(v) if _per_expert(v, model_sd[name]) else v
                    for key, v in state[name].items()
                }
        return {"model": model, "optim": {**optim_sd, "state": state}}

    @staticmethod
    def unwrap(state: dict[str, Any]) -> dict[str, Any]:
        """Back to local tensors (what `set_state_dict` takes)."""
        from torch.distributed.tensor import DTensor

        local = lambda sd: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in sd.items()}  # noqa: E731
        optim = state["optim"]
        moments = {name: local(m) for name, m in optim.get("state", {}).items()}
        return {"model": local(state["model"]), "optim": {**optim, "state": moments}}

    def _sharded(self, local: torch.Tensor) -> Any:
        """The local shard as the EP row's DTensor (sharded on the expert dimension)."""
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False)


def _per_expert(value: Any, param: torch.Tensor) -> bool:
    """An optimizer entry shaped like its expert parameter (a moment, not the step count)."""
    return isinstance(value, torch.Tensor) and value.shape == param.shape
