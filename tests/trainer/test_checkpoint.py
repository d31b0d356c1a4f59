import json
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fixtures.dist import run_ranks
from meshscope.trainer.checkpoint import MANIFEST, CheckpointError, CheckpointManager, _sha256, verify

REPO = Path(__file__).resolve().parents[2]


def small(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()  # Adam has state only after a step
    return model, opt


def test_round_trip_keeps_last_k_and_verifies(tmp_path):
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1, keep=2, async_save=False)
    model, opt = small(0)
    for step in (5, 10, 15):
        mgr.save(step, model, opt, {"rng": torch.get_rng_state(), "step": step})
    assert [p.name for p in mgr.checkpoints()] == ["step_00000010", "step_00000015"]
    assert verify(mgr.checkpoints()[-1])["step"] == 15
    fresh, fresh_opt = small(1)
    restored, refused = mgr.restore(fresh, fresh_opt)
    assert restored.step == 15 and refused == []
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_corrupt_checkpoint_is_refused_with_the_reason_and_the_previous_used(tmp_path):
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1, keep=3, async_save=False)
    model, opt = small(0)
    mgr.save(5, model, opt, {"step": 5})
    saved_at_5 = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1)
    mgr.save(10, model, opt, {"step": 10})
    newest = mgr.checkpoints()[-1]
    shard = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="fails its checksum"):
        verify(newest)
    fresh, fresh_opt = small(1)
    restored, refused = mgr.restore(fresh, fresh_opt)
    assert restored.step == 5
    assert len(refused) == 1 and "step_00000010" in refused[0] and "corrupt" in refused[0]
    assert torch.equal(fresh.weight, saved_at_5)


def test_kill_during_a_write_resumes_from_the_previous_good_checkpoint(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests/trainer/checkpoint_writer.py"), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    try:
        assert proc.stdout.readline().startswith("saved 1")
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".step_*.partial/*")) and time.monotonic() < deadline:
            time.sleep(0.005)  # wait until the next checkpoint is half written
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert list(tmp_path.glob(".step_*.partial")), "the kill should land mid-write"
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1, async_save=False)
    path, refused = mgr.agreed()
    assert path is not None and refused == []
    step = verify(path)["step"]
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])
    restored, _ = mgr.restore(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert restored.step == step
    torch.manual_seed(0)
    expected = torch.nn.Linear(1024, 1024).weight + step  # every save added 1 to every weight
    assert torch.equal(model[0].weight, expected)


def _nodes_without_a_shared_folder(rank: int, world_size: int, root: str, drop: list[str]) -> Any:
    """Two "nodes" of two ranks, each with its own checkpoint folder; `drop` removes some of the
    second node's checkpoints before the resume; returns (steps held, resumed step or error)."""
    node = rank // 2
    folder = Path(root) / f"node{node}"
    mgr = CheckpointManager(folder, rank=rank, world_size=world_size, async_save=False, node=node)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (4, 8):
        with torch.no_grad():
            model.weight.fill_(step)
        mgr.save(step, model, opt, {"step": step})
    dist.barrier()
    if rank == 2:
        for name in drop:
            shutil.rmtree(Path(root) / "node1" / name)
    dist.barrier()
    held = sorted(p.name for p in folder.glob("step_*"))
    try:
        restored, refused = mgr.restore(model, opt)
    except CheckpointError as err:
        return held, str(err)
    return held, (restored and restored.step, float(model.weight[0, 0]), refused)


def test_nodes_without_a_shared_folder_each_keep_a_whole_copy_and_resume_at_one_step(tmp_path):
    both = run_ranks(_nodes_without_a_shared_folder, 4, root=str(tmp_path), drop=[])
    assert [held for held, _ in both] == [["step_00000004", "step_00000008"]] * 4  # no .partial left
    assert [r[:2] for _, r in both] == [(8, 8.0)] * 4
    # the second node lost its newest: the job goes back to the newest step every node has
    back = run_ranks(_nodes_without_a_shared_folder, 4, root=str(tmp_path / "b"), drop=["step_00000008"])
    assert [r[:2] for _, r in back] == [(4, 4.0)] * 4
    assert "not on every node" in back[0][1][2][0]
    # nothing in common: every rank refuses (rather than two halves training from different steps)
    none = run_ranks(
        _nodes_without_a_shared_folder, 4, root=str(tmp_path / "c"), drop=["step_00000004", "step_00000008"]
    )
    assert all(isinstance(r, str) and "no checkpoint in common" in r for _, r in none), none


def _fail_with_a_checkpoint_in_flight(rank: int, world_size: int, root: str) -> list[str]:
    """Stage a checkpoint whose background write is slow, then fail as a broken collective
    does; returns the checkpoints visible once the failure is handled."""
    from meshscope.collector import DistEnv
    from meshscope.trainer.config import TrainerConfig
    from meshscope.trainer.elastic import ElasticRun

    cfg = TrainerConfig(run_id="r", runs_root=Path(root), elastic={"checkpoint_every": 4})
    elastic = ElasticRun(cfg, DistEnv(rank=rank, world_size=world_size), mon=None)
    finish = elastic.ckpt._finish

    def slow_disk(*args: Any) -> None:
        time.sleep(1.0)
        finish(*args)

    elastic.ckpt._finish = slow_disk
    model, opt = small(rank)
    elastic.ckpt.save(4, model, opt, {"step": 4})
    elastic.mark_failed(RuntimeError("gloo: wrong split sizes"))
    return [p.name for p in elastic.ckpt.checkpoints()]


def test_a_worker_failing_with_a_checkpoint_in_flight_lets_it_land_first(tmp_path):
    # the save has its own group, which the failed collective did not break; without the wait
    # the restart would begin from the checkpoint before (here: none, step 0)
    held = run_ranks(_fail_with_a_checkpoint_in_flight, 2, root=str(tmp_path))
    assert held == [["step_00000004"]] * 2


class _Planted:
    """What a crafted checkpoint file would carry: a callable run on unpickling."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_crafted_local_state_file_is_refused_and_runs_nothing(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", rank=0, world_size=1, keep=2, async_save=False)
    model, opt = small(0)
    mgr.save(5, model, opt, {"rng": torch.get_rng_state(), "hook": {"iter": 3}, "step": 5})
    restored, _ = mgr.restore(*small(1))
    assert mgr.local_state(restored)["hook"] == {"iter": 3}  # what meshscope writes loads
    marker = tmp_path / "ran"
    torch.save({"rng": _Planted(marker)}, restored.path / "local_rank0.pt")
    with pytest.raises(CheckpointError, match="refusing to load it"):
        mgr.local_state(restored)
    assert not marker.exists()


def test_a_crafted_dcp_metadata_file_is_refused_and_runs_nothing(tmp_path):
    """DCP reads `.metadata` with plain pickle: meshscope reads it through an unpickler that
    knows a checkpoint's metadata and nothing more."""
    mgr = CheckpointManager(tmp_path / "ckpt", rank=0, world_size=1, keep=2, async_save=False)
    model, opt = small(0)
    mgr.save(5, model, opt, {"step": 5})
    newest = mgr.checkpoints()[-1]
    marker = tmp_path / "ran"
    (newest / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    manifest = json.loads((newest / MANIFEST).read_text())
    # the attacker rewrites the checksums too: they are integrity, not trust
    manifest["files"] = {name: _sha256(newest / name) for name in manifest["files"]}
    (newest / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="not part of a checkpoint's metadata"):
        mgr.restore(*small(1))
    assert not marker.exists()
