"""The flight log sees DDP's C++ all-reduce as one record a step: issued as backward starts,
completed once every bucket is reduced, nothing under no_sync(); DDP keeps its C++ path. The
Monitor's own expert-load sum is one record a window, on the control plane's group. PyTorch's
own point-to-point usage (P2POp, batch_isend_irecv, torch.distributed.pipelining), FSDP2 and
DTensor's functional collectives work and compute the same with the flight log installed, and
are recorded."""

from __future__ import annotations

from pathlib import Path

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


def _monitor(rank: int, world_size: int, run_dir: str):
    """A Monitor on this rank (its flight log installed), as a user's loop builds it."""
    from pathlib import Path

    from prometheus_client import CollectorRegistry

    from meshscope.collector.env import DistEnv
    from meshscope.collector.monitor import Monitor
    from meshscope.collector.monitor_config import MonitorConfig

    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size)
    config = MonitorConfig(run_dir=Path(run_dir) / str(rank), metrics_port=None)
    return Monitor(config, env=env, registry=CollectorRegistry())


def _p2p_records(mon, rank: int, run_dir: str) -> list[tuple[str, str]]:
    """Close the Monitor; its flight log's point-to-point records (op, state); torch's own
    functions back for the next test in this process."""
    from pathlib import Path

    from meshscope.collector.flightlog import FlightLog
    from meshscope.collector.flightread import latest_logs, read_flight

    mon.close()
    (head,) = latest_logs(Path(run_dir) / str(rank) / "live").values()
    FlightLog.uninstall()
    return [(r.op, r.state) for r in read_flight(head.path).records if r.p2p]


def _p2p_patterns(rank: int, world_size: int, run_dir: str, monitored: bool) -> dict:
    """PyTorch's own point-to-point usage (its docs' ring with P2POp and batch_isend_irecv,
    a pipeline's isend/irecv pair), with or without a Monitor's flight log installed."""
    import torch
    import torch.distributed as dist

    mon = _monitor(rank, world_size, run_dir) if monitored else None
    send = torch.arange(2, dtype=torch.float32) + 2 * rank
    recv = torch.empty(2)
    ring = [
        dist.P2POp(dist.isend, send, (rank + 1) % world_size),
        dist.P2POp(dist.irecv, recv, (rank - 1 + world_size) % world_size),
    ]
    for req in dist.batch_isend_irecv(ring):
        req.wait()
    stage = torch.full((3,), float(rank))
    work = dist.isend(stage, 1) if rank == 0 else dist.irecv(stage, 0)
    work.wait()
    ops = _p2p_records(mon, rank, run_dir) if mon is not None else []
    return {"ring": recv.tolist(), "stage": stage.tolist(), "ops": ops}


def test_pytorchs_own_point_to_point_patterns_work_the_same_under_the_flight_log(tmp_path):
    """P2POp checks its op against torch's own isend/irecv by identity: the flight log must
    not turn them into functions torch refuses (or sends as receives)."""
    plain = run_ranks(_p2p_patterns, 2, run_dir=str(tmp_path / "plain"), monitored=False)
    logged = run_ranks(_p2p_patterns, 2, run_dir=str(tmp_path / "logged"), monitored=True)
    same = [{k: r[k] for k in ("ring", "stage")} for r in logged]
    assert same == [{k: r[k] for k in ("ring", "stage")} for r in plain]
    assert plain[1]["ring"] == [0.0, 1.0] and plain[1]["stage"] == [0.0, 0.0, 0.0]
    for rank, result in enumerate(logged):  # recorded: the ring's two ops and the stage's one
        stage = "isend" if rank == 0 else "irecv"
        assert [op for op, _ in result["ops"]] == ["isend", "irecv", stage], result
        assert {state for _, state in result["ops"]} == {"completed"}, result  # gloo: no future


def _pipeline(rank: int, world_size: int, run_dir: str, monitored: bool) -> dict:
    """torch.distributed.pipelining: two stages of a Linear, GPipe over two micro-batches,
    two steps; the last stage's losses and each stage's gradient, with or without a Monitor."""
    import torch
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    mon = _monitor(rank, world_size, run_dir) if monitored else None
    torch.manual_seed(rank)
    layer = torch.nn.Linear(8, 8)
    stage = PipelineStage(layer, stage_index=rank, num_stages=world_size, device=torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, y: (out - y).pow(2).mean())
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    losses: list = []
    for _ in range(2):
        schedule.step(x) if rank == 0 else schedule.step(target=y, losses=losses)
    ops = sorted({op for op, _ in _p2p_records(mon, rank, run_dir)}) if mon is not None else []
    return {"losses": [round(float(v), 6) for v in losses], "grad": layer.weight.grad.tolist(), "ops": ops}


def test_a_two_stage_pipeline_trains_the_same_under_the_monitor_and_its_sends_are_recorded(tmp_path):
    plain = run_ranks(_pipeline, 2, run_dir=str(tmp_path / "plain"), monitored=False)
    logged = run_ranks(_pipeline, 2, run_dir=str(tmp_path / "logged"), monitored=True)
    assert [(r["losses"], r["grad"]) for r in logged] == [(r["losses"], r["grad"]) for r in plain]
    assert len(plain[1]["losses"]) == 2  # the last step's two micro-batches
    assert all({"isend", "irecv"} <= set(r["ops"]) for r in logged), [r["ops"] for r in logged]


def _sharded(rank: int, world_size: int, run_dir: str, monitored: bool) -> dict:
    """FSDP2 (`fully_shard` on a DeviceMesh) trains two steps, then a DTensor is redistributed
    from shards to a replica (a functional all-gather), with or without a Monitor."""
    from pathlib import Path

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from meshscope.collector.flightlog import FlightLog
    from meshscope.collector.flightread import latest_logs, read_flight

    mon = _monitor(rank, world_size, run_dir) if monitored else None
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(rank)
    losses = []
    for _ in range(2):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(round(loss.item(), 6))
    shards = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    full = shards.redistribute(mesh, [Replicate()]).to_local().tolist()  # the funcol gather
    records = []
    if mon is not None:
        mon.close()
        (head,) = latest_logs(Path(run_dir) / str(rank) / "live").values()
        FlightLog.uninstall()
        records = [(r.op, r.state, r.site) for r in read_flight(head.path).records]
    return {"losses": losses, "full": full, "records": records}


def test_fsdp2_and_dtensor_run_the_same_under_the_monitor_and_their_collectives_are_recorded(tmp_path):
    plain = run_ranks(_sharded, 2, run_dir=str(tmp_path / "plain"), monitored=False)
    logged = run_ranks(_sharded, 2, run_dir=str(tmp_path / "logged"), monitored=True)
    assert [(r["losses"], r["full"]) for r in logged] == [(r["losses"], r["full"]) for r in plain]
    assert plain[0]["full"] == [float(i) for i in range(8)]
    for result in logged:
        records = result["records"]
        ops = {op for op, _, _ in records}
        assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= ops, records  # FSDP2's
        assert {state for _, state, _ in records} == {"completed"}, records
        # the functional all-gather of the redistribution, at the line that asked for it
        line = next(
            i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if "funcol gather" in text
        )
        assert any(op == "all_gather_into_tensor" and f":{line} " in site for op, _, site in records), records


def test_a_step_end_written_late_leaves_a_slot_the_ring_gave_away_alone(tmp_path):
    """The Monitor's drain writes a host step's end a round late (`FlightLog.defer_ends`): the
    reduction it completes is completed then, unless more records than the ring holds came in
    between, when its slot holds a newer record that must stay as it is."""
    from meshscope.collector.flightfixed import fixed_tail
    from meshscope.collector.flightlog import FlightLog
    from meshscope.collector.flightread import read_flight

    log = FlightLog(tmp_path, rank=0, world_size=1, capacity=8)
    log.defer_ends = True

    def issue(site: str) -> int:
        return log.append_fixed("g", fixed_tail(b"g", 1, b"all_reduce", b"float32", b"4", site.encode()))

    def states() -> dict[str, str]:
        return {r.site: r.state for r in read_flight(log.path).records}

    kept = issue("reduction 0")
    log.step_begin(0)
    log.step_end(reduced=[kept])
    assert states()["reduction 0"] == "issued"  # queued, not written yet
    log.settle_ends()
    assert states()["reduction 0"] == "completed"
    gone = issue("reduction 1")
    log.step_begin(1)
    log.step_end(reduced=[gone])
    for i in range(8):  # the ring (8 records) comes round: the slot now holds a newer record
        issue(f"later {i}")
    log.settle_ends()
    assert "reduction 1" not in states() and states()["later 7"] == "issued", states()
    log.close()
