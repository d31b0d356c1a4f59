"""`meshscope run` with a poisoned module: the tracer names it, and `meshscope replay` re-runs it."""

from __future__ import annotations

import pytest

from fixtures.ports import free_port_range
from fixtures.runs import meshscope, start_run
from meshscope.collector.store import load_events


@pytest.mark.parametrize("where,tensor,replays", [("forward", "parameter", 0), ("backward", "gradient", 1)])
@pytest.mark.parametrize("device", ["cpu", "sim"])  # gloo, and NCCL's semantics (simnccl)
def test_the_tracer_names_the_poisoned_module_and_rank(tmp_path, where, tensor, replays, device):
    module = "blocks.1.moe.router.gate"
    proc = start_run(
        tmp_path,
        "t",
        free_port_range(3),
        "--device",
        device,
        "--steps",
        "10",
        "--inject",
        f"nan@step=4,rank=1,module={module},where={where}",
    )
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    events = load_events(tmp_path / "t")
    nans = events[events["kind"] == "nan"].sort_values(["step", "id"])
    # The first finding is the fault. On the simulated device (the host runs ahead of its
    # stream) a busy host can let the poisoned update reach the peers before the flag lands;
    # their findings then come later and are downstream. On the CPU nothing spreads.
    assert len(nans) == 1 if device == "cpu" else len(nans) >= 1 and (nans["step"].iloc[1:] > 4).all(), nans
    row = nans.iloc[0]
    detail = row["detail"]
    assert (row["rank"], row["step"]) == (1, 4)
    assert (detail["module"], detail["where"], detail["tensor"]) == (module, where, tensor)
    snapshots = events[events["kind"] == "snapshot"]
    paths = [d["path"] for d in snapshots["detail"]]
    assert detail["snapshot"] in paths and (len(paths) == 1 or device == "sim"), paths
    # forward: the Inf weight is in the snapshot, so the re-run gives Inf again (exit 0);
    # backward: the NaN came from a hook, not the module, and replay says so (exit 1)
    replay = meshscope("replay", detail["snapshot"])
    assert replay.returncode == replays, replay.stdout + replay.stderr
    assert module in replay.stdout
