"""Where the time went: a job's wall time cut into goodput and badput buckets that add up to it,
on a recorded timeline whose every second is known (a checkpoint's hold, a straggler's wait, a
hang the watchdog aborted, the restart, the restore and the steps it redid)."""

import math

import pytest
from prometheus_client import CollectorRegistry

from meshscope.collector.schema import Event, StepRecord
from meshscope.collector.store import RunStore, load_events, load_retried_steps, load_steps
from meshscope.collector.timeaccount import BUCKETS, PRODUCTIVE, TimeAccountCollector, time_account

T0 = 1000.0


def _step(rank, step, start, attempt, exposed=0.0, data=0.0):
    return StepRecord(
        run_id="r", rank=rank, world_size=2, step=step, time=start, step_s=0.8,
        comm_exposed_s=exposed, data_s=data, attempt=attempt,
    )  # fmt: skip


def _recorded(run_dir):
    """Attempt 0 runs steps 0-4 (a checkpoint after step 2 holds 0.15 s; rank 0 waits 0.2 s a
    step for the slower rank 1), hangs after step 4 until the watchdog aborts at +9; attempt 1 starts at
    +10, resumes from step 3 and redoes steps 3-4, then step 5; the run ends at +15.5."""
    store = RunStore(run_dir)
    store.add_event(
        Event(kind="run_start", run_id="r", rank=0, detail={"process_started_at": T0}, time=T0 + 2)
    )
    for step in range(5):
        for rank in (0, 1):  # rank 1 is slower all through attempt 0: rank 0 waits 0.2 s a step
            exposed = 0.3 if rank == 0 else 0.1
            store.add_step(
                _step(rank, step, T0 + 2 + step, 0, exposed=exposed, data=0.1 if step == 1 else 0.0)
            )
    store.add_event(
        Event(kind="checkpoint", run_id="r", rank=0, detail={"saved_step": 2, "held_s": 0.15}, time=T0 + 5)
    )
    store.add_event(
        Event(kind="hang", run_id="r", rank=0, detail={"type": "stuck", "action": "abort"}, time=T0 + 9)
    )
    store.flush()  # attempt 0's rows are in before attempt 1 redoes steps 3 and 4
    resumed = {
        "process_started_at": T0 + 10,
        "group_ready_at": T0 + 10.5,
        "restored_at": T0 + 11,
        "from_step": 3,
    }
    store.add_event(Event(kind="resume", run_id="r", rank=0, step=3, detail=resumed, time=T0 + 11.2))
    for step in (3, 4, 5):
        for rank in (0, 1):
            store.add_step(_step(rank, step, T0 + 12 + (step - 3), 1))
    store.add_event(Event(kind="run_end", run_id="r", rank=0, detail={"steps": 6}, time=T0 + 15.5))
    store.close()


def test_the_buckets_add_up_to_the_wall_time_and_each_second_is_where_it_went(tmp_path):
    _recorded(tmp_path)
    account = time_account(load_steps(tmp_path), load_retried_steps(tmp_path), load_events(tmp_path))
    assert account.wall_s == pytest.approx(15.5)
    for rank, buckets in account.ranks.items():
        assert sum(buckets.values()) == pytest.approx(account.wall_s), rank
        assert all(seconds >= 0 for seconds in buckets.values()), buckets
    r0, r1 = account.ranks[0], account.ranks[1]
    expected = {
        "startup": 2.0 + 0.5 + 1.0,  # worker start to step 0; after the restart, start-up and model build
        "checkpoint_restore": 0.5,
        "checkpoint_save": 0.15,
        "data_loading": 0.1,
        # attempt 0's steps 3 and 4, the time on the way to them after the save, and between them
        "wasted_progress": 0.05 + 0.8 + 0.2 + 0.8,
        "hang": 9 - 6.8,  # the end of attempt 0's step 4 to the abort
        "restart": 1.0,  # the abort to the new workers' start
    }
    for bucket, seconds in expected.items():
        assert r0[bucket] == pytest.approx(seconds), bucket
    # rank 0 waited for rank 1 in the steps that were kept (0-2); the rest is communication
    assert r0["straggler"] == pytest.approx(0.6) and r1["straggler"] == 0.0
    assert r0["gradient_comm"] == pytest.approx(0.3) == r1["gradient_comm"]
    assert r0["idle"] == pytest.approx(0.2 + 0.2 + 0.2 + 0.2 + 0.7)
    assert account.job["straggler"] == pytest.approx(0.3)  # the job's figure: the mean over ranks
    assert sum(account.job.values()) == pytest.approx(account.wall_s)
    productive = sum(account.job[b] for b in PRODUCTIVE)
    assert account.ettr == pytest.approx(productive / 15.5)
    assert "ETTR" in account.text() and "hang" in account.text()


def test_a_run_without_steps_has_an_empty_account_and_no_counters(tmp_path):
    RunStore(tmp_path).close()  # a store, no step yet
    account = time_account(load_steps(tmp_path), load_retried_steps(tmp_path), load_events(tmp_path))
    assert account.wall_s == 0 and math.isnan(account.ettr) and account.text() == "n/a (no steps)"
    registry = CollectorRegistry()
    registry.register(TimeAccountCollector(tmp_path))
    assert registry.get_sample_value("meshscope_time_seconds_total", {"bucket": "compute"}) is None


def test_prometheus_gets_a_counter_per_bucket_that_agrees_with_the_account(tmp_path):
    _recorded(tmp_path)
    registry = CollectorRegistry()
    registry.register(TimeAccountCollector(tmp_path))
    account = time_account(load_steps(tmp_path), load_retried_steps(tmp_path), load_events(tmp_path))
    for bucket in BUCKETS:
        value = registry.get_sample_value("meshscope_time_seconds_total", {"bucket": bucket})
        assert value == pytest.approx(account.job[bucket]), bucket


def test_jitter_between_balanced_ranks_is_no_straggler_but_a_slow_rank_is(tmp_path):
    """In lockstep every step waits for whichever rank was late this time; only a rank slower
    step after step makes the others wait for its pace. Steps 0-39 jitter (busy time 0.6 s
    +- 0.03 on both ranks); from step 20 rank 1 is 0.2 s slower."""
    import numpy as np

    rng = np.random.default_rng(0)
    store = RunStore(tmp_path)
    start = T0
    for step in range(40):
        busy = 0.6 + rng.normal(0, 0.03, size=2) + np.array([0.0, 0.2 if step >= 20 else 0.0])
        step_s = float(busy.max()) + 0.05  # everyone leaves the reduction when the last arrives
        for rank in (0, 1):
            exposed = step_s - float(busy[rank])
            store.add_step(
                StepRecord(
                    run_id="r",
                    rank=rank,
                    world_size=2,
                    step=step,
                    time=start,
                    step_s=step_s,
                    comm_exposed_s=exposed,
                )
            )
        start += step_s
    store.close()
    account = time_account(load_steps(tmp_path), load_retried_steps(tmp_path), load_events(tmp_path))
    steps = load_steps(tmp_path)
    raw_wait = 0.0  # the old measure: exposed beyond the least-waiting rank's, step by step
    for _, same in steps[steps["step"] < 20].groupby("step"):
        raw_wait += float((same["comm_exposed_s"] - same["comm_exposed_s"].min()).sum())
    r0, r1 = account.ranks[0]["straggler"], account.ranks[1]["straggler"]
    assert 20 * 0.2 * 0.85 < r0 < 20 * 0.2 * 1.15, r0  # rank 0 waited for rank 1's pace
    assert r1 < 0.1 * r0, (r0, r1)  # the slow rank waited for nobody's
    balanced = r0 + r1 - 20 * 0.2  # what the balanced half was charged, both ranks
    assert balanced < 0.5 * raw_wait, (balanced, raw_wait)


def test_steps_timed_one_in_ten_are_accounted_from_their_nearest_timed_step(tmp_path):
    """A user's loop on the host times one step in 10 (`monitor.detail_every`): the steps
    between take their rank's nearest timed shares, so the buckets stay where they were, not
    compute because nothing was timed."""
    import numpy as np

    def account(timed_every):
        run = tmp_path / str(timed_every)
        store = RunStore(run)
        for step in range(60):
            for rank in (0, 1):
                exposed = 0.3 if rank == 0 else 0.1
                timed = step % timed_every == 0
                store.add_step(
                    StepRecord(
                        run_id="r", rank=rank, world_size=2, step=step, time=T0 + step, step_s=0.8,
                        comm_exposed_s=exposed if timed else math.nan, data_s=0.05 if timed else math.nan,
                    )
                )  # fmt: skip
        store.close()
        return time_account(load_steps(run), load_retried_steps(run), load_events(run))

    every, sampled = account(1), account(10)
    assert load_steps(tmp_path / "10")["comm_exposed_s"].isna().sum() == 2 * 54  # NaN kept in the store
    for bucket in ("compute", "gradient_comm", "straggler", "data_loading"):
        assert sampled.job[bucket] == pytest.approx(every.job[bucket], rel=1e-6), bucket
    assert every.job["gradient_comm"] > 0 and np.isclose(sampled.wall_s, every.wall_s)
