"""1-bit Adam on 2 gloo ranks: a full-precision warm-up, then frozen variance and the momentum
averaged 1 bit per value; the ranks stay identical, the loss follows uncompressed Adam, and
the wire carries a small fraction of the bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from fixtures.dist import run_ranks


def _train(
    rank: int, world_size: int, run_dir: str, compression: str, steps: int = 30, inject: str = ""
) -> dict:
    from prometheus_client import CollectorRegistry

    from meshscope.collector.env import DistEnv
    from meshscope.collector.monitor import Monitor
    from meshscope.collector.monitor_config import MonitorConfig
    from meshscope.collector.store import load_steps
    from meshscope.trainer.config import TrainerConfig
    from meshscope.trainer.device import Device
    from meshscope.trainer.inject import Injector, parse_injection
    from meshscope.trainer.loop import build, train_step

    train = {"batch_size": 4, "steps": steps, "compression": compression, "compression_warmup": 8, "lr": 3e-3}
    cfg = TrainerConfig(nproc=world_size, model={"d_model": 32, "heads": 2}, train=train)
    env = DistEnv(
        rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size, torchrun=True
    )
    config = MonitorConfig(run_dir=Path(run_dir) / str(rank), metrics_port=None, flight_log=False)
    mon = Monitor(config, env=env, registry=CollectorRegistry())
    device = Device("cpu")
    injector = Injector([parse_injection(inject)] if inject else [], rank, lambda inj, step: None)
    state = build(cfg, device, mon, rank=rank, world_size=world_size, injector=injector)
    for _ in range(steps):
        train_step(state, mon, cfg, device, injector)
    mon.close()
    rows = load_steps(config.run_dir).sort_values("step")
    return {
        "optimizer": type(state.optimizer).__name__,
        "loss": rows["loss"].tolist(),
        "grad_norm": rows["grad_norm"].tolist(),
        "wire": rows["bytes_wire"].tolist(),
        "params": [p.detach().clone() for p in state.model.parameters()],
    }


def test_onebit_adam_keeps_ranks_identical_follows_adam_and_sends_a_sliver(tmp_path):
    import torch

    plain = run_ranks(_train, 2, run_dir=str(tmp_path / "none"), compression="none")
    onebit = run_ranks(_train, 2, run_dir=str(tmp_path / "onebit"), compression="onebit_adam")
    assert onebit[0]["optimizer"] == "OneBitAdam"
    # every rank applies the same averaged momentum: the replicas never drift apart
    assert all(torch.equal(a, b) for a, b in zip(onebit[0]["params"], onebit[1]["params"]))
    # the warm-up is Adam on averaged gradients; afterwards the loss keeps following plain Adam's
    # (AdamW without bias correction or weight decay differs from torch's AdamW in its first steps)
    tail = lambda r: sum(r["loss"][-10:]) / 10  # noqa: E731
    assert tail(onebit[0]) == pytest.approx(tail(plain[0]), rel=0.05)
    assert tail(onebit[0]) < onebit[0]["loss"][0] - 0.1  # it learns
    full, compressed = plain[0]["wire"][-1], onebit[0]["wire"][-1]
    assert onebit[0]["wire"][0] == pytest.approx(full, rel=0.01)  # warm-up: full precision
    assert 0 < compressed <= full / 16  # after: the 1-bit momentum only


@pytest.mark.parametrize("compression", ["fp16", "powersgd", "onebit", "onebit_adam"])
def test_a_nan_on_one_rank_skips_the_step_everywhere_under_every_compression(tmp_path, compression):
    """The skip is agreed before any collective of the step: no rank runs the optimizer's
    collective alone (1-bit Adam's momentum all-reduce), the replicas stay identical, and no
    error feedback keeps the NaN past its step."""
    import math

    import torch

    runs = run_ranks(
        _train, 2, run_dir=str(tmp_path), compression=compression, steps=14, inject="nan@step=10,rank=1"
    )
    assert all(len(r["loss"]) == 14 for r in runs), [len(r["loss"]) for r in runs]
    assert math.isnan(runs[1]["loss"][10])  # the poisoned step
    for r in runs:  # and training goes on after it, on every rank: no memory kept the NaN
        assert all(math.isfinite(v) for v in r["loss"][11:] + r["grad_norm"][11:]), r
    assert all(torch.equal(a, b) for a, b in zip(runs[0]["params"], runs[1]["params"]))
