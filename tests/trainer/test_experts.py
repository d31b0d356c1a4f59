"""Expert parallelism: experts sharded over EP groups of a data x expert mesh train the same
model as replicated experts under DDP, the Monitor sees the all-to-all, and checkpoints keep
each expert once and restore it at any number of data replicas."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fixtures.dist import run_ranks

MODEL = {"experts": 4, "d_model": 32, "heads": 2, "layers": 2}


def _trainer(rank: int, world_size: int, ep: int, run_dir: str, device: str, **parallel):
    """The reference trainer's state on this rank, watched by a Monitor writing under `run_dir`."""
    from prometheus_client import CollectorRegistry

    from meshscope.collector.env import DistEnv
    from meshscope.collector.monitor import Monitor
    from meshscope.collector.monitor_config import MonitorConfig
    from meshscope.trainer.config import TrainerConfig
    from meshscope.trainer.device import Device
    from meshscope.trainer.loop import build

    model = {**MODEL, "capacity_factor": 2.0} if parallel else MODEL  # 2.0 = E / top_k: none dropped
    cfg = TrainerConfig(
        nproc=world_size, parallel={"ep": ep, **parallel}, model=model, train={"batch_size": 4}
    )
    env = DistEnv(
        rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size, torchrun=True
    )
    config = MonitorConfig(
        run_dir=Path(run_dir) / str(rank), metrics_port=None, flight_log=False, expert_every=2, detail_every=1
    )
    mon = Monitor(config, env=env, registry=CollectorRegistry())
    dev = Device(device)
    dev.activate()
    return cfg, dev, mon, build(cfg, dev, mon, rank=rank, world_size=world_size), config.run_dir


def _checkpoints(root: str, rank: int, world_size: int, state):
    from meshscope.trainer.checkpoint import CheckpointManager
    from meshscope.trainer.experts import ShardedExperts

    ckpt = CheckpointManager(Path(root), rank=rank, world_size=world_size, async_save=False)
    ckpt.sharded = ShardedExperts(state.model, state.experts.mesh) if state.experts else None
    return ckpt


def _held(state) -> dict:
    """The last MoE layer's experts this rank holds (global index -> w1, Adam's first moment)."""
    layer = state.model.blocks[-1].moe
    held = layer.expert_mesh.local_experts(4) if layer.expert_mesh else range(4)
    w1 = layer.experts.w1
    moment = state.optimizer.state[w1]["exp_avg"]
    return {e: (w1[i].detach().clone(), moment[i].clone()) for i, e in enumerate(held)}


def _train(
    rank: int, world_size: int, ep: int, run_dir: str, device: str, save: str = "", steps: int = 4, **parallel
) -> dict:
    """`steps` steps on this rank; its losses, grad norms, step records, the experts it holds,
    and (with `save`) a checkpoint written there."""
    from meshscope.collector.store import load_expert_work, load_steps
    from meshscope.trainer.inject import Injector
    from meshscope.trainer.loop import train_step

    cfg, dev, mon, state, store = _trainer(rank, world_size, ep, run_dir, device, **parallel)
    injector = Injector([], rank, lambda inj, step: None)
    layer = state.model.blocks[0].moe
    cap = layer.capacity(cfg.train.batch_size * cfg.model.seq_len)
    kept, work = [], []
    for _ in range(steps):
        train_step(state, mon, cfg, dev, injector)
        kept.append(layer.expert_token_counts.clamp(max=cap).sum().item())  # routed, within capacity
        work.append(layer.expert_work.sum().item() if layer.expert_work.numel() else 0.0)
    if save:
        _checkpoints(save, rank, world_size, state).save(steps, state.model, state.optimizer, {})
    mon.close()
    rows = load_steps(store).sort_values("step").to_dict("records")
    stored = load_expert_work(store)
    return {
        "stored_work": stored[stored["layer"] == 0].set_index("step")["tokens"].to_dict(),
        "work_per_step": work,
        "loss": [r["loss"] for r in rows],
        "grad_norm": [r["grad_norm"] for r in rows],
        "rows": rows,
        "experts": {e: w.sum().item() for e, (w, _) in _held(state).items()},
        "held": _held(state),
        "dense": state.model.embed.weight.detach().sum().item(),
        "work": layer.expert_work.tolist(),
        "kept": kept[-1],
        "kept_per_step": kept,
        "capacity": cap,
    }


def _restore(rank: int, world_size: int, ep: int, run_dir: str, root: str) -> dict:
    """A fresh trainer at this layout, restored from the checkpoint under `root`."""
    _, _, mon, state, _ = _trainer(rank, world_size, ep, run_dir, "cpu")
    restored, refused = _checkpoints(root, rank, world_size, state).restore(state.model, state.optimizer)
    mon.close()
    assert restored is not None, refused
    return _held(state)


@pytest.fixture(scope="module")
def replicated(tmp_path_factory) -> list[dict]:
    """The reference: 4 data-parallel ranks on gloo, every expert replicated under DDP."""
    return run_ranks(_train, world_size=4, ep=1, run_dir=str(tmp_path_factory.mktemp("dp")), device="cpu")


@pytest.mark.parametrize("backend,device", [("gloo", "cpu"), ("simnccl", "sim")], ids=["gloo", "sim"])
def test_experts_sharded_over_a_2x2_mesh_train_the_replicated_model(tmp_path, replicated, backend, device):
    """Same seed, same data: 4 ranks as 2 (data) x 2 (expert) end where 4 data-parallel ranks
    with every expert replicated end, step by step (float rounding apart), on gloo and on the
    simulated accelerator (collectives complete later than they are enqueued)."""
    save = str(tmp_path / "ckpt") if backend == "gloo" else ""
    sharded = run_ranks(
        _train, world_size=4, backend=backend, ep=2, run_dir=str(tmp_path), device=device, save=save
    )
    for dp, ep in zip(replicated, sharded):
        assert ep["loss"] == pytest.approx(dp["loss"], rel=1e-5)
        assert ep["grad_norm"] == pytest.approx(dp["grad_norm"], rel=1e-5)  # one norm: all clip alike
        assert ep["dense"] == pytest.approx(dp["dense"], rel=1e-5)
    held = {}
    for rank, ep in enumerate(sharded):
        assert sorted(ep["experts"]) == ([0, 1] if rank % 2 == 0 else [2, 3])  # E/ep each, in order
        for expert, value in ep["experts"].items():
            held.setdefault(expert, value)
            assert value == held[expert]  # the replicas of an expert (a column of the mesh) agree
    assert held == pytest.approx(replicated[0]["experts"], rel=1e-5)
    # every token slot sent was processed by the rank holding its expert, and no more
    for row in (sharded[:2], sharded[2:]):
        assert sum(sum(r["work"]) for r in row) == sum(r["kept"] for r in row)
        assert all(w <= 2 * r["capacity"] for r in row for w in r["work"])
    if backend == "gloo":
        _the_monitor_saw_the_all_to_all(sharded, replicated)
        _the_checkpoint_restores_at_other_layouts(tmp_path, Path(save), sharded)


def _the_monitor_saw_the_all_to_all(sharded: list[dict], replicated: list[dict]) -> None:
    # each rank's experts' work, per window of 2 steps, in the store: what the EP row's ranks
    # routed within capacity is what its ranks' experts processed
    for r in sharded:
        assert r["stored_work"] == {1: sum(r["work_per_step"][:2]), 3: sum(r["work_per_step"][2:])}
    for row in (sharded[:2], sharded[2:]):
        for window in (1, 3):
            done = sum(r["stored_work"][window] for r in row)
            assert done == sum(sum(r["kept_per_step"][window - 1 : window + 1]) for r in row)
    assert all(not r["stored_work"] for r in replicated)  # a per-rank fact of expert parallelism only
    # per layer and step: dispatch [E, C, d+1] and combine [E, C, d] forward, and their
    # gradients backward; a rank sends (ep-1)/ep of each
    e, cap, d, layers = 4, sharded[0]["capacity"], 32, 2
    sent = layers * 2 * (e * cap * (d + 1) * 4 + e * cap * d * 4) // 2
    for r in sharded:
        for row in r["rows"]:
            assert row["bytes_a2a"] == sent
            assert row["comm_a2a_s"] > 0 and row["comm_exposed_s"] >= row["comm_a2a_s"]
    assert all(math.isnan(row["comm_a2a_s"]) and row["bytes_a2a"] == 0 for row in replicated[0]["rows"])


def _the_checkpoint_restores_at_other_layouts(tmp_path: Path, root: Path, sharded: list[dict]) -> None:
    """Written by 2 x 2 ranks, each expert once; read back by 2 ranks still sharding them (the
    job shrank to one data replica) and by 2 ranks holding every expert (ep 1)."""
    saved = {e: wm for r in sharded for e, wm in r["held"].items()}
    for ep in (2, 1):
        for held in run_ranks(
            _restore, world_size=2, ep=ep, run_dir=str(tmp_path / f"r{ep}"), root=str(root)
        ):
            assert held.keys() <= saved.keys() and len(held) == 4 // ep
            for expert, (w, moment) in held.items():
                assert torch.equal(w, saved[expert][0]) and torch.equal(moment, saved[expert][1]), expert


def test_dropless_dispatch_trains_the_model_that_drops_nothing(tmp_path):
    """Uneven all-to-all splits, every token to its expert: the same numbers as replicated
    experts with capacity for every token, and each rank's experts did exactly their tokens."""
    kw = {"world_size": 2, "device": "cpu"}
    whole = run_ranks(_train, ep=1, run_dir=str(tmp_path / "dp"), dispatch="capacity", **kw)
    dropless = run_ranks(_train, ep=2, run_dir=str(tmp_path / "ep"), dispatch="dropless", **kw)
    for dp, ep in zip(whole, dropless):
        assert ep["loss"] == pytest.approx(dp["loss"], rel=1e-5)
        assert ep["grad_norm"] == pytest.approx(dp["grad_norm"], rel=1e-5)
    held = {e: v for r in dropless for e, v in r["experts"].items()}
    assert held == pytest.approx(whole[0]["experts"], rel=1e-5)
    routed = 2 * 4 * 32 * 2  # ranks x sequences x tokens x top-k: nothing dropped
    assert sum(sum(r["work"]) for r in dropless) == routed
    assert all(r["rows"][-1]["bytes_a2a"] > 0 for r in dropless)


def _state_by_expert(state) -> dict:
    """Every parameter and Adam moment this rank holds, experts under their global index (where
    a placement put them), dense ones under their name."""
    out = {}
    for name, p in state.model.named_parameters():
        moments = state.optimizer.state.get(p, {})
        tensors = [p.detach(), *(moments[k] for k in ("exp_avg", "exp_avg_sq") if k in moments)]
        layer = state.model.get_submodule(name.rsplit(".experts.", 1)[0]) if ".experts." in name else None
        if layer is None or getattr(layer, "expert_mesh", None) is None:
            out[name] = [t.clone() for t in tensors]
            continue
        per = len(layer.slot_expert) // layer.expert_mesh.ep
        slots = layer.slot_expert.tolist()[layer.expert_mesh.ep_rank * per :][:per]
        for local, expert in enumerate(slots):
            out[f"{name}[{expert}]"] = [t[local].clone() for t in tensors]
    return out


def _moved(rank: int, world_size: int, run_dir: str, device: str, move: bool, save: str = "") -> dict:
    """6 steps on a 2 (data) x 2 (expert) mesh; with `move`, every layer's experts are re-placed
    (reversed) after step 2, as a live re-placement does at a step boundary."""
    from meshscope.collector.control import ControlPlane
    from meshscope.collector.store import load_steps
    from meshscope.trainer.inject import Injector
    from meshscope.trainer.loop import train_step
    from meshscope.trainer.placement import move_experts

    cfg, dev, mon, state, store = _trainer(rank, world_size, 2, run_dir, device, dispatch="dropless")
    plane = ControlPlane()
    injector = Injector([], rank, lambda inj, step: None)
    cost = None
    for step in range(6):
        train_step(state, mon, cfg, dev, injector)
        if move and step == 2:
            for moe in state.model.moe_layers():
                cost = move_experts(moe, state.optimizer, [3, 2, 1, 0], plane.agree_all)
    dev.synchronize()
    if save:
        _checkpoints(save, rank, world_size, state).save(6, state.model, state.optimizer, {})
    mon.close()
    held = _state_by_expert(state)
    return {"loss": load_steps(store)["loss"].tolist(), "state": held, "cost": cost}


@pytest.mark.parametrize("device,backend", [("cpu", "gloo"), ("sim", "simnccl")], ids=["gloo", "sim"])
def test_a_live_re_placement_moves_experts_without_changing_the_model(tmp_path, device, backend):
    """Experts (weights and both Adam moments) re-placed mid-run on two data replicas: every
    later step computes what the run that kept its placement computes, every parameter and
    moment of the model ends as there (each expert on its new rank), and only the experts that
    changed rank travelled. Dropless dispatch, where a placement matters (each expert computes
    its own tokens); static capacity maps slots the same way (`slot_order`). On the simulated
    accelerator too, whose point-to-point work completes later than it is enqueued."""
    run = dict(world_size=4, backend=backend, device=device)
    kept = run_ranks(_moved, run_dir=str(tmp_path / "kept"), move=False, **run)
    root = str(tmp_path / "ckpt") if device == "cpu" else ""
    moved = run_ranks(_moved, run_dir=str(tmp_path / "moved"), move=True, save=root, **run)
    for a, b in zip(kept, moved):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and len(b["loss"]) == 6
    kept_state = {k: v for r in kept for k, v in r["state"].items()}
    for rank, result in enumerate(moved):
        assert sorted(k for k in result["state"] if "experts.w1[" in k and "blocks.1" in k) == [
            f"blocks.1.moe.experts.w1[{e}]" for e in ((2, 3) if rank % 2 == 0 else (0, 1))
        ]
        for name, tensors in result["state"].items():
            for got, want in zip(tensors, kept_state[name], strict=True):
                assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), (rank, name)
    cost = moved[0]["cost"]
    one_expert = sum(
        t.numel() * 4 for k, ts in moved[0]["state"].items() if "blocks.1" in k and "[3]" in k for t in ts
    )
    assert cost["moved"] == [0, 1, 2, 3] and cost["bytes"] == 4 * one_expert
    if not root:
        return
    # its checkpoint (experts in slot order, with the placement) read by a run holding every
    # expert: each expert where that run expects it
    whole = run_ranks(_restore, world_size=2, ep=1, run_dir=str(tmp_path / "whole"), root=root)
    for expert in range(4):
        w = (
            moved[0]["state"].get(f"blocks.1.moe.experts.w1[{expert}]")
            or moved[1]["state"][f"blocks.1.moe.experts.w1[{expert}]"]
        )
        assert torch.equal(whole[0][expert][0], w[0]), expert


def _corrupted_move(rank: int, world_size: int, run_dir: str, placement: list[int]) -> dict:
    """A re-placement whose transfer arrives corrupted on rank 3 alone (one EP row of two):
    every rank of the job refuses it alike, and every expert, weights and moments, stays."""
    import torch.distributed as dist

    from meshscope.collector.control import ControlPlane
    from meshscope.trainer.inject import Injector
    from meshscope.trainer.loop import train_step
    from meshscope.trainer.placement import PlacementFailed, move_experts

    cfg, dev, mon, state, _ = _trainer(rank, world_size, 2, run_dir, "cpu", dispatch="dropless")
    plane = ControlPlane()
    train_step(state, mon, cfg, dev, Injector([], rank, lambda inj, step: None))
    moe = state.model.blocks[1].moe
    before = _state_by_expert(state)
    real = dist.batch_isend_irecv

    def corrupting(ops):
        for work in real(ops):
            work.wait()
        for op in ops:  # a bit flip on the wire, on one rank
            if rank == 3 and op.op is dist.irecv and op.tensor.is_floating_point():
                op.tensor.view(torch.int32).view(-1)[0] ^= 1
        return []  # waited for here

    dist.batch_isend_irecv = corrupting
    try:
        move_experts(moe, state.optimizer, placement, plane.agree_all)
        refused = ""
    except PlacementFailed as err:
        refused = str(err)
    finally:
        dist.batch_isend_irecv = real
    mon.close()
    after = _state_by_expert(state)
    kept = all(torch.equal(a, b) for k in before for a, b in zip(before[k], after[k]))
    return {"refused": refused, "kept": kept and moe.slot_expert.tolist() == [0, 1, 2, 3]}


def test_a_re_placement_that_fails_its_checksum_anywhere_moves_nothing_on_any_rank(tmp_path):
    """Rank 3's row alone saw the bad arrival; rows must agree (replicas of an expert hold the
    same one), so ranks 0 and 1 refuse it too."""
    for result in run_ranks(_corrupted_move, world_size=4, run_dir=str(tmp_path), placement=[3, 2, 1, 0]):
        assert "nothing was moved" in result["refused"] and result["kept"], result


def test_the_checksum_sees_a_flipped_bit_and_a_swap():
    from meshscope.trainer.placement import checksum

    x = torch.randn(3, 5)
    flipped = x.clone()
    flipped.view(torch.int32).view(-1)[7] ^= 1 << 20
    swapped = x.clone()
    swapped[0, 0], swapped[0, 1] = x[0, 1], x[0, 0]
    sums = [checksum([t]).tolist() for t in (x, flipped, swapped)]
    assert len({tuple(s) for s in sums}) == 3 and checksum([x.clone()]).tolist() == sums[0]
    assert checksum([torch.ones(3, dtype=torch.uint8)]).dtype == torch.int64  # an odd byte count


def _restore_refused(rank: int, world_size: int, run_dir: str, root: str) -> str:
    from meshscope.trainer.checkpoint import CheckpointError

    _, _, mon, state, _ = _trainer(rank, world_size, 2, run_dir, "cpu")
    try:
        _checkpoints(root, rank, world_size, state).restore(state.model, state.optimizer)
    except CheckpointError as err:
        return str(err)
    finally:
        mon.close()
    return ""


def test_expert_parallelism_turned_on_at_a_resume_from_a_replicated_checkpoint_is_refused_clearly(tmp_path):
    root = str(tmp_path / "ckpt")
    run_ranks(_train, world_size=2, ep=1, run_dir=str(tmp_path / "dp"), device="cpu", save=root)
    said = run_ranks(_restore_refused, world_size=2, run_dir=str(tmp_path / "ep"), root=root)
    assert all("without expert parallelism" in s and "parallel.ep=1" in s for s in said), said
