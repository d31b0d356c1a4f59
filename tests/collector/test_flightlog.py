"""The flight log sees DDP's C++ all-reduce as one record a step: issued as backward starts,
completed once every bucket is reduced, nothing under no_sync(); DDP keeps its C++ path. The
Monitor's own expert-load sum is one record a window, on the control plane's group."""

from __future__ import annotations

from fixtures.dist import run_ranks


def _records(rank: int, world_size: int, run_dir: str) -> dict:
    from pathlib import Path

    import torch
    from prometheus_client import CollectorRegistry
    from torch.nn.parallel import DistributedDataParallel as DDP

    from meshscope.collector.env import DistEnv
    from meshscope.collector.flightread import latest_logs, read_flight
    from meshscope.collector.monitor import Monitor
    from meshscope.collector.monitor_config import MonitorConfig
    from meshscope.collector.store import load_expert_load

    class Routed(torch.nn.Linear):  # speaks the MoE protocol: 4 experts, rank-dependent load
        def forward(self, x):
            self.expert_token_counts = torch.tensor([3, 1, 0, rank], dtype=torch.int64)
            return super().forward(x)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), Routed(32, 4))
    model[1].expert_token_counts = torch.zeros(4, dtype=torch.int64)
    ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets, one record
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size)
    config = MonitorConfig(run_dir=Path(run_dir) / str(rank), metrics_port=None, expert_every=2)
    mon = Monitor(config, env=env, registry=CollectorRegistry())
    mon.watch(ddp)
    python_hook = ddp._get_ddp_logging_data().get("comm_hook", "")
    for _step in range(3):
        with mon.step(tokens=4):
            ddp(torch.randn(4, 32)).sum().backward()
    with ddp.no_sync():  # gradient accumulation: no reduction, no record
        with mon.step(tokens=4):
            ddp(torch.randn(4, 32)).sum().backward()
    mon.close()  # settles the last window's sum
    (head,) = latest_logs(config.run_dir / "live").values()
    records = [(r.op, r.group, r.seq, r.step, r.state, r.site) for r in read_flight(head.path).records]
    load = load_expert_load(config.run_dir) if rank == 0 else None
    return {"records": records, "hook": python_hook, "load": load}


def test_ddp_reduction_is_one_record_a_step_and_ddp_keeps_its_cpp_path(tmp_path):
    for result in run_ranks(_records, 2, run_dir=str(tmp_path)):
        assert not result["hook"], result["hook"]  # no Python comm hook registered
        ddp = [r for r in result["records"] if r[5].startswith("DDP gradients")]
        assert [(op, seq, step, state) for op, _, seq, step, state, _ in ddp] == [
            ("all_reduce", 0, 0, "completed"),
            ("all_reduce", 1, 1, "completed"),
            ("all_reduce", 2, 2, "completed"),
        ], result["records"]


def test_the_expert_load_sum_is_one_record_a_window_on_the_control_plane(tmp_path):
    from meshscope.collector.expert_counts import EXPERT_LOAD_SITE

    results = run_ranks(_records, 2, run_dir=str(tmp_path))
    for result in results:
        ddp_group = next(g for _, g, *_, site in result["records"] if site.startswith("DDP gradients"))
        sums = [r for r in result["records"] if r[5] == EXPERT_LOAD_SITE]
        # windows close at steps 1 and 3 (the no_sync step is step 3); each sum completed
        assert [(op, seq, step, state) for op, _, seq, step, state, _ in sums] == [
            ("all_reduce", 0, 1, "completed"),
            ("all_reduce", 1, 3, "completed"),
        ], result["records"]
        assert {g for _, g, *_ in sums} != {ddp_group}  # meshscope's own group, not the job's
    load = results[0]["load"].sort_values(["step", "expert"])
    # two forwards a window on two ranks: [3, 1, 0, rank] summed
    assert load[load["step"] == 1]["tokens"].tolist() == [12, 4, 0, 2]
