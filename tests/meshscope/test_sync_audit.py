"""No unmarked sync in a step on the real multi-rank path, on the simulated accelerator: DDP with
a compression hook, the control plane, expert counts, the tracer, the flight log and the
gradient inspector; every host read of a tensor value is counted by call site."""

from __future__ import annotations

import json

import pytest
import torch

from fixtures.runs import start_run
from meshscope.collector.syncaudit import SyncAudit


def test_the_audit_counts_an_unmarked_read_and_honours_marks():
    audit = SyncAudit(lambda: 3).install()
    try:
        t = torch.ones(2)
        t.sum().item()
        t.tolist()  # sync point: a deliberate one
        float(t[0])  # host tensor
    finally:
        audit.uninstall()
    report = audit.report()
    assert report["steps"] == 1
    assert list(report["unmarked"].values()) == [1] and "Tensor.item" in next(iter(report["unmarked"]))
    assert sorted(k.rsplit("(", 1)[1] for k in report["marked"]) == ["host tensor)", "sync point)"]
    assert torch.Tensor.item.__name__ == "item" and not hasattr(torch.Tensor.item, "__wrapped__")


def test_the_audit_counts_a_blocking_copy_to_the_device_and_not_a_non_blocking_one():
    """On the sim the host is the device: `.to(device)` is the host-to-device copy that a real
    accelerator makes the host wait for, unless it is non-blocking (from pinned memory)."""
    audit = SyncAudit(lambda: 0, host_is_device=True).install()
    try:
        t = torch.ones(4)
        t.to("cpu")
        t.to(torch.device("cpu"), torch.float64)
        t.to(t)
        t.to("cpu", non_blocking=True)
        t.to(torch.float16)  # a dtype change stays on its device
        torch.zeros(4).copy_(t)  # same device: not a transfer
    finally:
        audit.uninstall()
    assert sum(audit.unmarked.values()) == 3, audit.unmarked
    assert all(key.startswith("Tensor.to at ") for key in audit.unmarked), audit.unmarked
    assert torch.Tensor.to.__name__ == "to" and not hasattr(torch.Tensor.to, "__wrapped__")


@pytest.mark.parametrize(
    "setup",
    [
        ("--compression", "powersgd", "--trace", "nonfinite"),
        # the blocking copies once in the step: 1-bit's bit weights, dropless's expert work
        ("--compression", "onebit", "--set", "parallel.ep=2", "--set", "parallel.dispatch=dropless"),
    ],
    ids=["powersgd-tracer", "onebit-dropless"],
)
def test_a_two_rank_sim_run_has_no_unmarked_sync_per_step(tmp_path, setup):
    proc = start_run(
        tmp_path,
        "a",
        None,
        *("--device", "sim", "--nproc", "2", "--steps", "12", *setup, "--set", "audit_syncs=true"),
    )
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / "a" / "sync_audit" / f"rank{rank}.json").read_text())
        assert report["steps"] == 12, report
        assert report["unmarked"] == {}, f"rank {rank}: syncs nobody marked: {report['unmarked']}"
        assert report["marked"], "the audit saw no read at all: its wrapping did not reach the step"
