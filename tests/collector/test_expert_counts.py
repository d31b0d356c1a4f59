"""Where the Monitor's expert-load sum runs: on the host with no listener, the training thread
only hands a closed window over and the service thread sums it on the plane's service group;
a listener (a trainer's bias update) gets the sum on the training thread, at the step after
the window closed, on every rank alike. Both give the same load."""

from __future__ import annotations

from fixtures.dist import run_ranks


def _routed(rank: int, world_size: int, counts):
    """A DDP model whose second layer speaks the MoE protocol (4 experts, `counts()` routed
    per forward), and this rank's DistEnv."""
    import torch

    from meshscope.collector.env import DistEnv

    class Routed(torch.nn.Linear):
        def forward(self, x):
            self.expert_token_counts = torch.tensor(counts(), dtype=torch.int64)
            return super().forward(x)

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Routed(8, 4))
    model[1].expert_token_counts = torch.zeros(4, dtype=torch.int64)
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size)
    return torch.nn.parallel.DistributedDataParallel(model), env


def _sums(rank: int, world_size: int, run_dir: str, listen: bool) -> dict:
    import threading
    import time
    from pathlib import Path

    import torch
    from prometheus_client import CollectorRegistry

    from meshscope.collector import expert_counts
    from meshscope.collector.monitor import Monitor
    from meshscope.collector.monitor_config import MonitorConfig
    from meshscope.collector.store import load_expert_load

    issued: list[tuple[str, int]] = []  # (thread, group's id; -1: the control plane's) of every sum
    real_start = expert_counts.start_sum

    def start_sum(group, tensor, site, step=None):
        issued.append((threading.current_thread().name, id(group)))
        return real_start(group, tensor, site, step)

    expert_counts.start_sum = start_sum
    plane_start = expert_counts.ExpertCounts._start

    def training_start(self, step):  # the training-thread path goes through the control plane
        issued.append((threading.current_thread().name, -1))
        return plane_start(self, step)

    expert_counts.ExpertCounts._start = training_start
    expert_counts.GROUP_S = 1e-9  # a group a window: each one summed by a round, none by close()

    ddp, env = _routed(rank, world_size, lambda: [3, 1, 0, rank])  # rank-dependent load
    config = MonitorConfig(
        run_dir=Path(run_dir) / str(rank), metrics_port=None, expert_every=2, drain_interval_s=0.01
    )
    mon = Monitor(config, env=env, registry=CollectorRegistry())
    heard: list[tuple[int, int, list[int]]] = []  # (step heard at, window's step, load of layer 0)
    if listen:
        mon.expert_load_listeners.append(lambda step, load: heard.append((mon._step, step, load[0].tolist())))
    mon.watch(ddp)
    handed = []  # windows waiting for the service thread after each step
    for _ in range(4):
        with mon.step(tokens=4):
            ddp(torch.randn(4, 8)).sum().backward()
        handed.append(len(mon.experts._handed))
        deadline = time.monotonic() + 30
        while (mon.experts._handed or mon.experts._group_sum is not None) and time.monotonic() < deadline:
            time.sleep(0.005)  # the service thread's round, not close(), sums the window
    mon.close()
    load = load_expert_load(config.run_dir) if rank == 0 else None
    return {
        "issued": issued,
        "service_group": id(mon.control.service_group),
        "handed": handed,
        "heard": heard,
        "load": None if load is None else load.sort_values(["step", "expert"])["tokens"].tolist(),
    }


def test_without_a_listener_the_service_thread_sums_each_window_on_its_own_group(tmp_path):
    results = run_ranks(_sums, 2, run_dir=str(tmp_path), listen=False)
    for result in results:
        # windows close at steps 1 and 3: each handed over as it closed, summed by the service
        # thread on the service group (never the host group the training thread issues on)
        assert result["issued"] == [("meshscope-monitor", result["service_group"])] * 2, result["issued"]
        assert result["handed"] in ([0, 1, 0, 1], [0, 0, 0, 0]), result["handed"]
        assert result["heard"] == []
    # two forwards a window on two ranks: [3, 1, 0, rank] summed, for both windows
    assert results[0]["load"] == [12, 4, 0, 2] * 2


def test_a_listener_gets_the_sum_on_the_training_thread_a_step_after_the_window(tmp_path):
    quiet, heard = (
        run_ranks(_sums, 2, run_dir=str(tmp_path / mode), listen=mode == "listen")
        for mode in ("quiet", "listen")
    )
    for result in heard:
        assert [thread for thread, _ in result["issued"]] == ["MainThread"] * 2, result["issued"]
        # every rank hears each window at the step after it closed (the last at close),
        # summed over both ranks
        assert result["heard"] == [(2, 1, [12, 4, 0, 2]), (3, 3, [12, 4, 0, 2])], result["heard"]
    # the same load reaches the store either way
    assert quiet[0]["load"] == heard[0]["load"] == [12, 4, 0, 2] * 2


def _grouped(rank: int, world_size: int, run_dir: str) -> dict:
    import time
    from pathlib import Path

    import torch
    from prometheus_client import CollectorRegistry

    from meshscope.collector import expert_counts
    from meshscope.collector.monitor import Monitor
    from meshscope.collector.monitor_config import MonitorConfig
    from meshscope.collector.store import load_expert_load

    sizes: list[int] = []  # elements of every sum the service thread issued
    real_start = expert_counts.start_sum

    def start_sum(group, tensor, site, step=None):
        sizes.append(tensor.numel())
        return real_start(group, tensor, site, step)

    expert_counts.start_sum = start_sum

    forwards = iter(range(10**6))  # one window a step: [its step, 1, 0, rank]
    ddp, env = _routed(rank, world_size, lambda: [next(forwards), 1, 0, rank])
    config = MonitorConfig(
        run_dir=Path(run_dir) / str(rank),
        metrics_port=None,
        expert_every=1,
        drain_interval_s=0.05,
        record_every_s=0.25,
    )
    mon = Monitor(config, env=env, registry=CollectorRegistry())
    mon.watch(ddp)
    for step in range(60):
        with mon.step(tokens=4):
            ddp(torch.randn(4, 8)).sum().backward()
        time.sleep(0.01)  # windows come faster than the service thread's batches
        if step == 30 and rank == 0:
            mon.flush()  # on one rank alone, mid-run: its peer never flushes
    mon.close()
    load = load_expert_load(config.run_dir) if rank == 0 else None
    return {
        "sizes": sizes,
        "load": None
        if load is None
        else load.sort_values(["step", "expert"]).groupby("step")["tokens"].apply(list),
    }


def test_windows_are_summed_a_group_at_a_time_and_a_one_rank_flush_keeps_the_ranks_in_step(tmp_path):
    results = run_ranks(_grouped, 2, run_dir=str(tmp_path))
    for result in results:
        # the same groups on both ranks (a window is 4 counts, a group's sum ends with the
        # proposal): fewer all-reduces than windows, every window in one of them
        assert result["sizes"] == results[0]["sizes"]
        assert all(size % 4 == 1 for size in result["sizes"]), result["sizes"]
        assert sum(size // 4 for size in result["sizes"]) == 60
        assert len(result["sizes"]) < 30, result["sizes"]
    # each window's own sum over the two ranks, whatever group carried it
    load = results[0]["load"]
    assert list(load.index) == list(range(60))
    assert all(load[step] == [2 * step, 2, 0, 1] for step in range(60)), load


def test_a_rank_proposes_the_windows_two_seconds_hold_at_its_recent_pace(monkeypatch):
    """A group carries about GROUP_S of windows (one all-reduce wakes gloo's threads once in
    that time), at the pace of the last GROUP_S seconds: not a round's worth, not a backlog."""
    from meshscope.collector import expert_counts

    now = [100.0]
    monkeypatch.setattr(expert_counts.time, "monotonic", lambda: now[0])
    counts = expert_counts.ExpertCounts(every=5)
    proposals = []
    for _ in range(20):  # 16 windows a second, a round every 0.5 s
        now[0] += 0.5
        proposals.append(counts._propose(8))
    assert proposals[-1] == 32 == expert_counts.GROUP_S * 16
    for _ in range(8):  # the pace drops to 1 window a second: so does the proposal, within ~2 s
        now[0] += 0.5
        proposals.append(counts._propose(1 if len(proposals) % 2 else 0))
    assert proposals[-1] == 2, proposals
    now[0] += 60.0  # a long stall: at least one window
    assert counts._propose(0) == 1
    now[0] += 0.5
    assert counts._propose(10**6) == expert_counts.MAX_GROUP  # a burst is clamped


def test_a_groups_tables_are_each_windows_own_sum_whichever_layers_ran():
    """The service thread sums a group in one stack and one indexed add (`_group_tables`): each
    window's table equals the window's own sum (`_window_acc`, the training thread's path), for
    windows before any MoE forward (left out), windows where a layer did not run, float counts,
    and empty windows after a forward (zeros), with the proposal after the tables."""
    import torch
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from meshscope.collector.expert_counts import EXPERT_COUNT_DTYPE, ExpertCounts

    layers, experts = 3, 4
    forward = st.lists(st.integers(0, layers - 1), unique=True).map(sorted)  # the layers that ran
    window = st.lists(st.tuples(forward, st.booleans()), max_size=3)  # (layers, counts as float)

    def noted(spec, rng):
        return [
            (layer, torch.tensor(rng.integers(0, 50, experts), dtype=torch.float32 if f else torch.int64), 7)
            for ran, f in spec
            for layer in ran
        ]

    @settings(max_examples=60, deadline=None)
    @given(st.lists(window, min_size=1, max_size=6), st.integers(1, 64), st.integers(0, 2**31))
    def check(specs, proposal, seed):
        import numpy as np

        rng = np.random.default_rng(seed)
        windows = [(step, noted(spec, rng)) for step, spec in enumerate(specs)]
        fused, alone = ExpertCounts(every=1), ExpertCounts(every=1)
        fused.layers = alone.layers = [torch.nn.Identity()] * layers
        expected = [(step, acc) for step, n in windows if (acc := alone._window_acc(n)) is not None]
        got = fused._group_tables(windows, proposal)
        if not expected:
            assert got is None
            return
        steps, flat = got
        assert steps == [step for step, _ in expected]
        assert flat.dtype == EXPERT_COUNT_DTYPE and int(flat[-1]) == proposal
        assert torch.equal(flat[:-1], torch.cat([acc.reshape(-1) for _, acc in expected]))
        assert fused._like.shape == (layers, experts)

    check()
