"""The engine on synthetic runs with known faults: each is found, named, and is one episode."""

import numpy as np
import pandas as pd
import pytest

from meshscope.detectors.engine import DetectionEngine, EngineConfig
from meshscope.detectors.episodes import EpisodeTracker


def synthetic_run(
    steps=120, ranks=4, seed=0, slow=None, leak=None, nan_at=None, wave=False, device_leak=None
):
    """StepRecords of a healthy run, plus optional faults: slow=(rank, start, end, factor),
    leak=(rank, start, mb_per_step) in host memory, device_leak=(...) in device memory,
    nan_at=(rank, step)."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(steps):
        base = 0.1 * (1 + (0.3 * np.sin(step / 15) if wave else 0))  # a slow wave is no anomaly
        compute = base * (1 + 0.03 * rng.standard_normal(ranks))
        if slow and slow[1] <= step < slow[2]:
            compute[slow[0]] *= slow[3]
        step_s = compute.max() + 0.01
        for r in range(ranks):
            rss = 1e9 + (leak[2] * 2**20 * max(0, step - leak[1]) if leak and r == leak[0] else 0)
            dl = device_leak
            allocated = 4e9 + (dl[2] * 2**20 * max(0, step - dl[1]) if dl and r == dl[0] else 0)
            loss = 4.0 * np.exp(-step / 80) + 0.02 * rng.standard_normal()
            if nan_at == (r, step):
                loss = float("nan")
            rows.append(
                dict(
                    rank=r,
                    world_size=ranks,
                    step=step,
                    step_s=step_s,
                    data_s=0.0,
                    comm_exposed_s=step_s - compute[r],
                    comm_ratio=(step_s - compute[r]) / step_s,
                    bytes_wire=1000,
                    loss=loss,
                    grad_norm=1.0,
                    tokens=256,
                    mem_rss=rss,
                    mem_allocated=allocated,
                )
            )
    return pd.DataFrame(rows)


def run(df, **cfg):
    closed, opened = [], []
    engine = DetectionEngine(EngineConfig(**cfg), on_open=opened.append, on_close=closed.append)
    for end in range(10, df["step"].max() + 11, 10):  # fed in chunks, as when tailing a store
        engine.process(df[df["step"] < end])
    engine.finish()
    return opened, closed


def test_a_healthy_run_with_a_slow_wave_raises_nothing():
    opened, _ = run(synthetic_run(wave=True))
    assert opened == []


def test_one_straggler_episode_names_the_slow_rank():
    opened, closed = run(synthetic_run(slow=(2, 60, 75, 3.0)))
    assert [(e.type, e.ranks) for e in closed] == [("straggler", [2])]
    ep = closed[0]
    assert 60 <= ep.start_step <= 62 and 74 <= ep.end_step <= 75
    assert ep.detail()["evidence"]["ratio"] > 2


def test_memory_growth_and_nan_are_found_with_their_ranks():
    _, closed = run(synthetic_run(leak=(1, 70, 8.0), nan_at=(3, 50)))
    found = {(e.type, tuple(e.ranks)) for e in closed}
    assert ("nan", (3,)) in found and ("memory", (1,)) in found
    assert min(e.start_step for e in closed if e.type == "memory") <= 75


def test_a_nan_born_in_backward_is_a_nan_anomaly_though_the_loss_stays_finite():
    """An expert whose gradient turns NaN leaves the loss finite: the gradient norm says it
    (the step is skipped), and the anomaly is the same `nan` as a loss's, with its rank."""
    df = synthetic_run()
    bad = (df["rank"] == 2) & (df["step"] == 50)
    df.loc[bad, "grad_norm"] = float("nan")
    df["nonfinite"] = np.where(bad, "grad_norm", "")
    _, closed = run(df)
    found = [(e.type, e.ranks) for e in closed]
    assert ("nan", [2]) in found, found
    ep = next(e for e in closed if e.type == "nan")
    assert ep.start_step == 50 and ep.detail()["evidence"]["grad_norm"][2] == "nan"
    assert np.isfinite(df.loc[bad, "loss"]).all()


@pytest.mark.parametrize("column", ["grad_norm", "loss"])
def test_a_nan_on_every_rank_names_no_rank(column):
    """DDP averages gradients: one rank's NaN is every rank's after the reduction (a finite loss
    everywhere, a NaN norm everywhere). Under expert parallelism one holder's poisoned expert
    makes every rank's loss NaN (its output goes back to every sender). All ranks at once is
    a `nan` anomaly that names no culprit; one rank's own loss still names it."""
    df = synthetic_run()
    bad = df["step"] == 50
    df.loc[bad, column] = float("nan")
    df["nonfinite"] = np.where(bad, column, "")
    _, closed = run(df)
    nans = [e for e in closed if e.type == "nan"]
    assert len(nans) == 1 and not nans[0].ranks, [(e.type, e.ranks) for e in closed]
    assert "every rank" in nans[0].detail()["evidence"]["where"]
    _, closed = run(synthetic_run(nan_at=(2, 50)))
    assert [e.ranks for e in closed if e.type == "nan"] == [[2]]


def test_a_grad_norm_never_logged_is_no_nan():
    df = synthetic_run()
    df["grad_norm"] = float("nan")  # a loop that logs no gradient norm: NULL in the store
    df["nonfinite"] = ""
    _, closed = run(df)
    assert not any(e.type == "nan" for e in closed), [(e.type, e.ranks) for e in closed]


def test_a_device_memory_leak_is_found_while_host_memory_stays_flat():
    _, closed = run(synthetic_run(device_leak=(2, 60, 8.0)))
    leaks = [e for e in closed if e.type == "memory"]
    assert [e.ranks for e in leaks] == [[2]], [(e.type, e.ranks) for e in closed]
    assert leaks[0].start_step <= 66 and leaks[0].detail()["evidence"]["memory"] == "device"


def test_a_world_that_shrinks_starts_its_baselines_over():
    before = synthetic_run(steps=60, ranks=4)
    after = synthetic_run(steps=120, ranks=2, slow=(1, 100, 110, 3.0))
    after = after[after["step"] >= 60]
    _, closed = run(pd.concat([before, after]))
    assert [(e.type, e.ranks) for e in closed] == [("straggler", [1])]


def heterogeneous_run(
    steps=200,
    paces=(1.0, 1.05, 0.97, 1.1, 1.0, 1.0, 0.95, 1.02),
    seed=0,
    slow=(),
    factor=1.25,
    start=100,
    noise=0.02,
):
    """Workers with their own steady pace (some always a little slower), and `slow` ranks that
    become `factor` slower than their own pace from `start` on, for good."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(steps):
        compute = 0.1 * np.asarray(paces) * (1 + noise * rng.standard_normal(len(paces)))
        if step >= start:
            compute[list(slow)] *= factor
        step_s = compute.max() + 0.01
        for r, c in enumerate(compute):
            rows.append(
                dict(
                    rank=r,
                    world_size=len(paces),
                    step=step,
                    step_s=step_s,
                    data_s=0.0,
                    comm_exposed_s=step_s - c,
                    comm_ratio=(step_s - c) / step_s,
                    bytes_wire=1000,
                    loss=4.0 * np.exp(-step / 80),
                    grad_norm=1.0,
                    tokens=256,
                    mem_rss=1e9,
                )
            )
    return pd.DataFrame(rows)


def test_heterogeneous_workers_are_not_stragglers():
    for seed in range(3):
        opened, _ = run(heterogeneous_run(seed=seed))
        assert opened == [], seed


@pytest.mark.parametrize("slow, factor", [((3,), 1.2), ((3, 6), 1.25), ((1, 4, 6), 1.5), ((2,), 1.12)])
def test_subtle_and_several_persistent_stragglers_are_named_within_a_few_steps(slow, factor):
    opened, closed = run(heterogeneous_run(slow=slow, factor=factor))
    stragglers = [e for e in closed if e.type == "straggler"]
    assert stragglers and all(e.start_step <= 106 for e in stragglers)
    assert sorted(r for e in stragglers for r in e.ranks) == sorted(slow)  # one episode per rank
    assert all(e.start_step >= 100 for e in closed)  # nothing before the fault


TWO_PACED = (0.45,) * 6 + (1.5, 1.6, 1.7, 2.0)  # a job that always ran at two paces


@pytest.mark.parametrize("seed, noise", [(0, 0.02), (1, 0.05), (2, 0.05)])
def test_a_job_that_always_ran_at_two_paces_is_its_own_baseline(seed, noise):
    opened, _ = run(heterogeneous_run(seed=seed, paces=TWO_PACED, noise=noise, steps=300))
    assert [(e.type, e.ranks) for e in opened if e.type == "straggler"] == [], opened


def test_a_worker_leaving_the_fast_group_is_named_and_the_shift_flags_no_one_else():
    """One fast worker drops to the slow group's pace: the median of the others moves for
    everyone, yet only the worker that changed is a straggler."""
    _, closed = run(heterogeneous_run(paces=TWO_PACED, slow=(5,), factor=3.5, steps=300, start=150))
    assert [(e.type, e.ranks) for e in closed] == [("straggler", [5])], closed


def test_a_collapse_whose_windows_land_behind_the_steps_is_one_episode():
    """Tailing a live run, expert load lands a window or more behind the steps it sums: the
    steps' clock must not close an ongoing collapse between two of its windows."""
    df = synthetic_run(steps=120, ranks=2)
    windows = []
    for end in range(4, 120, 5):  # expert load every 5 steps, 4 experts, a collapse on 1 from 40 to 99
        collapsed = 40 <= end < 100
        tokens = [1200.0, 40.0, 40.0, 40.0] if collapsed else [330.0, 310.0, 320.0, 320.0]
        windows += [dict(step=end, layer=0, expert=e, tokens=t) for e, t in enumerate(tokens)]
    experts = pd.DataFrame(windows)
    closed = []
    engine = DetectionEngine(EngineConfig(), on_close=closed.append)
    for end in range(10, 131, 10):  # steps up to `end`, expert windows up to 20 steps behind
        engine.process(df[df["step"] < end], experts[experts["step"] < end - 20])
    engine.finish()
    collapses = [(e.start_step, e.end_step) for e in closed if e.type == "expert_imbalance" and e.expert == 0]
    assert len(collapses) == 1 and collapses[0][0] <= 44 and collapses[0][1] >= 94, collapses


def test_a_noisy_flag_before_a_fault_is_not_the_faults_start():
    # A lone flag, a quiet step, then the fault's own flags: the episode starts at the fault, not
    # at the noise two steps earlier; the noisy flag still counts towards confirmation, as the
    # on-and-off flags of a weak fault do.
    tracker, opened = EpisodeTracker(gap=3), []
    for step, flagged in [(38, True), (39, False), (40, True), (41, True), (42, True), (43, False)]:
        if flagged:
            score = 9.0 if step == 38 else 3.0  # a loud noisy step: neither its score nor evidence stays
            ep = tracker.flag(step, "straggler", score, ranks=[3], confirm=3, evidence={"at": step})
            opened += [ep] if ep else []
        tracker.close_quiet(step)
    assert [(e.start_step, e.announced_step, e.score, e.evidence) for e in opened] == [
        (40, 41, 3.0, {"at": 40})
    ]
    # once confirmed, the episode lives through quiet steps within its gap, start unchanged
    assert tracker.flag(45, "straggler", 3.0, ranks=[3], confirm=3) is None
    assert [(e.start_step, e.end_step) for e in tracker.close_all()] == [(40, 45)]


@pytest.mark.parametrize(
    "scores, start, announced",
    [
        ({39: 1.9, 40: 3.1, 41: 3.0, 42: 3.2}, 40, 42),  # a weak flag right before: not the start
        ({39: 2.9, 40: 3.1, 41: 3.0, 42: 3.2}, 39, 41),  # as strong as the fault: part of it
        ({39: 1.9, 40: 2.0, 41: 1.8, 42: 1.9}, 39, 41),  # a weak fault all along: all of it
    ],
)
def test_a_weak_flag_right_before_a_fault_neither_starts_nor_confirms_it(scores, start, announced):
    # No quiet step between the noise and the fault: the rule's line (1.5) tells them apart.
    tracker, opened = EpisodeTracker(gap=3), []
    for step, score in scores.items():
        ep = tracker.flag(step, "straggler", score, ranks=[1], confirm=3, evidence={"at": step}, line=1.5)
        opened += [ep] if ep else []
    found = [(e.start_step, e.announced_step, e.evidence) for e in opened]
    assert found == [(start, announced, {"at": start})]


def test_an_expert_that_hogs_then_starves_is_two_episodes_each_ending_with_its_flags():
    """Same layer and expert, two ways in turn: the hog ends when its flags do, and the
    starving is an episode of its own from its first flag."""
    tracker = EpisodeTracker(gap=3)
    for step, kind, share in [
        (80, "hog", 0.5),
        (84, "hog", 0.6),
        (104, "starve", 0.01),
        (108, "starve", 0.0),
    ]:
        tracker.flag(
            step,
            "expert_imbalance",
            1.0,
            layer=1,
            expert=2,
            evidence={"kind": kind, "share": share},
            gap=8,
            facet=kind,
            clock="expert_load",
        )
        tracker.close_quiet({"expert_load": step})
    found = sorted((e.evidence["kind"], e.start_step, e.end_step) for e in tracker.close_all())
    assert found == [("starve", 104, 108)]  # the hog closed on its own, quiet for its gap
    tracker = EpisodeTracker(gap=3)
    for step, kind in [(80, "hog"), (84, "hog"), (88, "starve")]:
        tracker.flag(step, "expert_imbalance", 1.0, layer=1, expert=2, evidence={"kind": kind}, facet=kind)
    assert sorted((e.evidence["kind"], e.start_step, e.end_step) for e in tracker.close_all()) == [
        ("hog", 80, 84),
        ("starve", 88, 88),
    ]


def _long_steps(df, steps, seconds, busy_rank=None):
    """Make `steps` longer by `seconds`: every rank waits in communication for it, or, with
    `busy_rank`, that rank computes through it while its peers wait."""
    df = df.copy()
    at = df["step"].isin(list(steps))
    df.loc[at, "step_s"] += seconds
    busy = at & (df["rank"] == busy_rank)
    df.loc[at & ~busy, "comm_exposed_s"] += seconds
    df["comm_ratio"] = df["comm_exposed_s"] / df["step_s"]
    return df


@pytest.mark.parametrize("onset", [50, 83])
def test_a_slow_link_is_comm_and_a_lone_long_wait_is_a_stall(onset):
    # Ten steps each 15x the usual, every rank waiting on the network: a slow link, one comm
    # episode from its first step, no stall. One such step alone: a stuck collective, a stall
    # announced at the step after it.
    _, closed = run(_long_steps(synthetic_run(), range(onset, onset + 10), 1.5))
    assert [(e.type, e.start_step, e.end_step, e.announced_step) for e in closed] == [
        ("comm", onset, onset + 9, onset + 1)
    ]
    _, closed = run(_long_steps(synthetic_run(), [onset], 1.5))
    assert [(e.type, e.start_step, e.end_step, e.announced_step) for e in closed] == [
        ("stall", onset, onset, onset + 1)
    ]


@pytest.mark.parametrize("busy_rank", [None, 1])
def test_a_lone_blip_shorter_than_a_second_is_no_stall_on_fast_steps(busy_rank):
    """On 11 ms steps a lone step 0.4 s longer is 36x the usual, yet no fault: a TCP
    retransmit (200 ms), a scheduler on a shared host or a GC pause makes such blips. 1.5 s is
    a stall (the check can fail)."""
    fast = synthetic_run()
    fast[["step_s", "comm_exposed_s"]] *= 0.1
    for extra, expected in ((0.4, []), (1.5, [("stall", 60)])):
        _, closed = run(_long_steps(fast, [60], extra, busy_rank=busy_rank))
        assert [(e.type, e.start_step) for e in closed] == expected, (extra, busy_rank)


def test_a_long_step_a_rank_spent_busy_is_a_stall_at_once():
    _, closed = run(_long_steps(synthetic_run(), range(60, 63), 1.5, busy_rank=1))
    assert [(e.type, e.start_step, e.end_step, e.announced_step) for e in closed] == [("stall", 60, 62, 60)]


def test_a_long_wait_on_the_last_step_is_still_a_stall():
    _, closed = run(_long_steps(synthetic_run(steps=120), [119], 1.5))
    assert [(e.type, e.start_step, e.announced_step) for e in closed] == [("stall", 119, 119)]


def test_one_off_costs_of_the_first_steps_do_not_hide_a_later_straggler():
    """As a live 2-rank run on a busy host recorded it: rank 1's forward took 17x its peer's on
    steps 1 and 5 (one-off costs: a lazy import, a first allocation), then it ran 3x slower
    for 8 steps from step 40. Two one-offs in a 20-step warm-up are not its noise."""
    df = synthetic_run(steps=60, ranks=2, slow=(1, 40, 48, 3.0))
    for step in (1, 5):
        at = (df["step"] == step) & (df["rank"] == 1)
        extra = 1.6  # seconds of compute on rank 1 alone; rank 0 waits for it
        df.loc[df["step"] == step, "step_s"] += extra
        df.loc[(df["step"] == step) & (df["rank"] == 0), "comm_exposed_s"] += extra
        df.loc[at, "comm_ratio"] = df.loc[at, "comm_exposed_s"] / df.loc[at, "step_s"]
    found = [(e.type, e.ranks, e.start_step) for e in run(df)[1]]
    assert [(kind, ranks) for kind, ranks, start in found if start >= 40] == [("straggler", [1])], found


def test_a_blip_that_costs_the_job_a_few_milliseconds_is_no_anomaly():
    """Flags that say what they cost open an episode once they cost MIN_COST_S together: three
    flags of a millisecond on 2 ms steps are noise; three of 10 ms are a straggler."""
    for each, opens in ((0.001, False), (0.01, True)):
        tracker = EpisodeTracker(gap=3)
        opened = [tracker.flag(s, "straggler", 2.5, ranks=[0], confirm=3, cost=each) for s in (56, 57, 58)]
        assert any(opened) == opens, each
        assert bool(tracker.close_all()) == opens


def _two_modes(ranks=8, steps=240, slow=None, seed=3):
    """A run whose ranks alternate between a 100 ms and a 160 ms step, each on its own beat
    (rank r is slow on steps where (step + r) % 2 == 0), or at random 30 % of steps; `slow`:
    (rank, start, factor) a straggler on top of its modes."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(steps):
        beat = (step + np.arange(ranks)) % 2 == 0 if seed % 2 else rng.random(ranks) < 0.3
        compute = 0.1 * (1 + 0.03 * rng.standard_normal(ranks)) * np.where(beat, 1.6, 1.0)
        if slow and step >= slow[1]:
            compute[slow[0]] *= slow[2]
        step_s = compute.max() + 0.01
        rows += [
            dict(
                rank=r, world_size=ranks, step=step, step_s=step_s, data_s=0.0,
                comm_exposed_s=step_s - compute[r], comm_ratio=(step_s - compute[r]) / step_s,
                bytes_wire=1000, loss=1.0, grad_norm=1.0, tokens=256, mem_rss=1e9, mem_allocated=4e9,
                forward_s=0.3 * compute[r],
            )
            for r in range(ranks)
        ]  # fmt: skip
    return pd.DataFrame(rows)


@pytest.mark.parametrize("seed", [3, 4], ids=["alternating", "random 30 %"])
def test_workers_with_two_step_time_modes_raise_nothing_and_a_straggler_among_them_is_named(seed):
    assert [(e.type, e.ranks) for e in run(_two_modes(seed=seed))[1]] == []
    found = [(e.type, e.ranks) for e in run(_two_modes(seed=seed, slow=(5, 150, 1.4)))[1]]
    # (its peers' wait can read as a communication episode before the straggler is confirmed)
    assert [ranks for kind, ranks in found if kind == "straggler"] == [[5]], found


@pytest.mark.parametrize("alternating", [True, False], ids=["alternating", "random 30 %"])
def test_a_trace_of_workers_with_two_step_time_modes_raises_nothing(alternating):
    """As a production cluster's per-worker step-time trace reads: 16 workers, each its own
    step time (no communication recorded), each alternating between 0.5 s and 0.8 s steps
    (on its own beat, or at random on 30 % of steps). Two modes are the normal."""
    rng = np.random.default_rng(7)
    rows = []
    for step in range(400):
        slow = (step + np.arange(16)) % 2 == 0 if alternating else rng.random(16) < 0.3
        rows += _worker_trace_rows(
            step, 0.5 * (1 + 0.05 * rng.standard_normal(16)) * np.where(slow, 1.6, 1.0)
        )
    assert [(e.type, e.ranks, e.start_step) for e in run(pd.DataFrame(rows))[1]] == []


def _worker_trace_rows(step, step_s):
    """One step of a per-worker step-time trace: each worker's own step time, nothing else."""
    return [
        dict(rank=r, world_size=len(step_s), step=step, step_s=step_s[r], data_s=0.0, comm_exposed_s=0.0,
             comm_ratio=0.0, bytes_wire=0, loss=np.nan, grad_norm=np.nan, tokens=0, mem_rss=0.0,
             mem_allocated=0.0)
        for r in range(len(step_s))
    ]  # fmt: skip


@pytest.mark.parametrize("until", [400, 330], ids=["lasting", "ending"])
@pytest.mark.parametrize("seed", [7, 9])
def test_a_worker_whose_mix_of_modes_changes_is_named_alone_while_it_lasts(seed, until):
    """Workers in two modes (0.5 s, and 0.8 s on 30 % of steps at random): two modes are the
    normal, and every step of a worker whose slow mode becomes its usual one (90 % of steps
    from step 250) is in a known mode. Its mix changed: it is named alone, within 70 steps
    (the share is read over `detectors.modes.MIX_ROWS` steps), for as long as the mix lasts."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(400):
        share = np.where((np.arange(16) == 3) & (250 <= step < until), 0.9, 0.3)
        step_s = 0.5 * (1 + 0.05 * rng.standard_normal(16)) * np.where(rng.random(16) < share, 1.6, 1.0)
        rows += _worker_trace_rows(step, step_s)
    found = [(e.type, e.ranks, e.start_step, e.end_step) for e in run(pd.DataFrame(rows))[1]]
    assert found and all(kind == "straggler" and ranks == [3] for kind, ranks, *_ in found), found
    assert 250 <= found[0][2] <= 320, found
    assert found[-1][3] >= 390 if until == 400 else until <= found[-1][3] <= until + 50, found


def _timed_one_in(df, every):
    """The run as a user's loop on the host records it: phases and the wait on one step in
    `every`, NaN between (`monitor.detail_every`)."""
    df = df.copy()
    untimed = df["step"] % every != 0
    df.loc[untimed, ["comm_exposed_s", "comm_ratio", "data_s"]] = np.nan
    return df


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_steps_timed_one_in_ten_raise_nothing_clean_and_name_only_the_straggler(seed):
    """Untimed steps carry each rank's last timed phases: no NaN reaches a model, a clean run
    stays quiet, and a straggler is named with no other rank (later, at the timed steps)."""
    # the rules that read phases learn from the timed rows of the warm-up's steps, 10 at least
    # (100 steps here), not 20 timed rows: a user's loop is judged from step 100, not 200
    assert run(_timed_one_in(synthetic_run(steps=400, seed=seed, wave=True), 10))[0] == []
    for onset in (150, 250):
        slow = (2, onset, onset + 70, 3.0)
        _, closed = run(_timed_one_in(synthetic_run(steps=400, seed=seed, slow=slow), 10))
        assert [(e.type, e.ranks) for e in closed] == [("straggler", [2])], closed
        assert onset <= closed[0].start_step <= onset + 10 and onset + 60 <= closed[0].end_step <= onset + 70
