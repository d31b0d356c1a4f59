"""The training step never reads a device value: a non-finite update is skipped on the device.

On the CPU nothing blocks, so the test forbids what would block on an accelerator (reading a
tensor on the host, `nonzero`, `bincount`) for the whole step, with the Monitor treating every
tensor as a device tensor (its window read-back path), as on a GPU.
"""

import pytest
import torch
from prometheus_client import CollectorRegistry

from fixtures.runs import REPO
from meshscope.collector import Monitor, MonitorConfig, readback
from meshscope.collector.store import load_steps
from meshscope.config import load_config
from meshscope.trainer.device import Device
from meshscope.trainer.inject import Injector, parse_injection
from meshscope.trainer.loop import build, build_optimizer, step_if_finite, train_step


def test_fused_adamw_skips_a_non_finite_step_on_the_device():
    model = torch.nn.Linear(3, 1)
    cfg = load_config(REPO / "fixtures/tiny.toml")
    opt = build_optimizer(model, cfg, Device("cpu"))
    assert opt.defaults["fused"]
    model(torch.ones(1, 3)).sum().backward()
    step_if_finite(opt, torch.tensor(1.0))
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {k: v.clone() for k, v in opt.state[model.weight].items()}
    for p in model.parameters():
        p.grad.fill_(float("nan"))
    step_if_finite(opt, torch.tensor(float("nan")))
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)  # weights untouched...
    for k, v in opt.state[model.weight].items():
        assert torch.equal(v, state_before[k])  # ...and so are the moments and the step count
    for p in model.parameters():
        p.grad.fill_(1.0)
    step_if_finite(opt, torch.tensor(1.0))
    assert not torch.equal(model.weight, before[0])


FORBIDDEN = {
    "Tensor": ("item", "tolist", "__bool__", "__float__", "__int__", "nonzero"),
    "torch": ("nonzero", "bincount", "unique"),
}


def forbid_host_reads(monkeypatch):
    """Refuse host reads of tensors, except the Monitor's landed read-back copies."""

    def refuse(name, original=None):
        def call(*a, **k):
            if original is not None and getattr(a[0], "_landed", False):
                return original(*a, **k)
            raise AssertionError(f"{name} in the training step: a host-device sync on accelerators")

        return call

    landing = readback.Readback.__init__

    def tag_landed(self, tensor):
        landing(self, tensor)
        self._host._landed = True  # pinned host memory, read once its event says done

    monkeypatch.setattr(readback.Readback, "__init__", tag_landed)
    for name in FORBIDDEN["Tensor"]:
        monkeypatch.setattr(torch.Tensor, name, refuse(f"Tensor.{name}", getattr(torch.Tensor, name)))
    for name in FORBIDDEN["torch"]:
        monkeypatch.setattr(torch, name, refuse(f"torch.{name}"))


def test_the_training_step_reads_nothing_from_the_device(tmp_path, monkeypatch):
    cfg = load_config(REPO / "fixtures/tiny.toml", {"runs_root": str(tmp_path), "run_id": "s"})
    monkeypatch.setattr(readback, "is_device_tensor", lambda v: isinstance(v, torch.Tensor))
    mon = Monitor(
        MonitorConfig(run_dir=cfg.run_dir, metrics_port=None, sync_every=4, expert_every=2),
        registry=CollectorRegistry(),
    )
    device = Device("cpu")
    state = build(cfg, device, mon, rank=0, world_size=1)
    injector = Injector([parse_injection("nan@step=2,rank=0")], 0, lambda inj, step: None)
    with monkeypatch.context() as strict:
        forbid_host_reads(strict)
        for _ in range(6):
            train_step(state, mon, cfg, device, injector)
    mon.close()
    steps = load_steps(cfg.run_dir)
    assert steps["step"].tolist() == list(range(6))
    loss = steps["loss"].tolist()
    assert loss[2] != loss[2]  # the poisoned step's loss is NaN...
    assert all(x == x for x in loss[3:])  # ...and its update was skipped: training goes on
    assert torch.isfinite(torch.cat([p.detach().flatten() for p in state.model.parameters()])).all()


@pytest.mark.parametrize("name", ["item", "__bool__"])
def test_the_forbidding_harness_catches_a_read(monkeypatch, name):
    forbid_host_reads(monkeypatch)
    with pytest.raises(AssertionError, match="host-device sync"):
        getattr(torch.ones(()), name)()
