import multiprocessing as mp
import os
import signal
import sqlite3
import time

import pytest

from meshscope.collector.schema import Event, StepRecord
from meshscope.collector.store import (
    RunStore,
    latest_step,
    load_events,
    load_expert_load,
    load_retried_steps,
    load_steps,
    store_path,
)


def rec(rank, step, **kw):
    return StepRecord(
        run_id="r",
        rank=rank,
        world_size=3,
        step=step,
        time=time.time(),
        step_s=0.1,
        **{"loss": 1.0 / (step + 1), **kw},
    )


def _writer(run_dir, rank, steps, pause):
    store = RunStore(run_dir, flush_interval_s=0.05)
    for step in range(steps):
        store.add_step(rec(rank, step))
        if pause:
            time.sleep(pause)
    store.add_event(Event(kind="info", run_id="r", rank=rank, detail={"done": rank}))
    store.close()


def test_all_ranks_write_while_a_reader_reads(tmp_path):
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(tmp_path, r, 200, 0.001)) for r in range(3)]
    for p in procs:
        p.start()
    seen = []
    while any(p.is_alive() for p in procs):
        try:
            seen.append(len(load_steps(tmp_path)))
        except FileNotFoundError:  # not there yet, or a writer is creating it
            pass
        time.sleep(0.05)
    for p in procs:
        assert p.exitcode == 0
    steps = load_steps(tmp_path)
    assert len(steps) == 600
    assert steps.groupby("rank")["step"].nunique().tolist() == [200, 200, 200]
    assert seen and seen == sorted(seen)  # readers saw a growing, consistent table
    events = load_events(tmp_path)
    assert sorted(d["done"] for d in events["detail"]) == [0, 1, 2]


def test_killed_writer_leaves_a_consistent_store(tmp_path):
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_writer, args=(tmp_path, 0, 100000, 0.0))
    p.start()
    deadline = time.time() + 20
    while latest_step(tmp_path) < 500 and time.time() < deadline:
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    conn = sqlite3.connect(store_path(tmp_path))
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    steps = load_steps(tmp_path)
    assert len(steps) >= 500
    assert steps["step"].tolist() == list(range(len(steps)))  # a prefix: no holes, no halves


def test_expert_load_round_trip(tmp_path):
    store = RunStore(tmp_path)
    store.add_expert_load(9, [[1.0, 2.0], [3.0, 4.0]])
    store.close()
    df = load_expert_load(tmp_path)
    assert df[["step", "layer", "expert", "tokens"]].values.tolist() == [
        [9, 0, 0, 1.0],
        [9, 0, 1, 2.0],
        [9, 1, 0, 3.0],
        [9, 1, 1, 4.0],
    ]


def test_flush_makes_queued_records_visible(tmp_path):
    store = RunStore(tmp_path, flush_interval_s=60)
    store.add_step(rec(0, 0))
    store.flush()
    assert len(load_steps(tmp_path)) == 1
    store.close()


def test_a_store_being_created_reads_as_not_there_yet(tmp_path):
    import sqlite3

    sqlite3.connect(tmp_path / "store.sqlite").close()  # a rank opened it, no schema yet
    with pytest.raises(FileNotFoundError, match="being created"):
        load_steps(tmp_path)


def test_nonfinite_mask_tells_unlogged_from_nan_with_and_without_the_column():
    import numpy as np
    import pandas as pd

    from meshscope.collector.schema import nonfinite_mask

    new = pd.DataFrame(
        {
            "rank": [0, 0, 1, 1],
            "loss": [np.nan, np.nan, np.nan, np.inf],
            "nonfinite": ["", "loss", None, "grad_norm,loss"],
        }
    )
    assert nonfinite_mask(new).tolist() == [False, True, False, True]
    # a store from before the column: NaN counts only on a rank that logged a loss at all
    old = pd.DataFrame({"rank": [0, 0, 1, 1], "loss": [1.0, np.nan, np.nan, np.nan]})
    assert nonfinite_mask(old).tolist() == [False, True, False, False]


def test_a_step_redone_by_a_later_attempt_keeps_the_earlier_row_apart(tmp_path):
    first = RunStore(tmp_path)
    for step in range(5):
        first.add_step(rec(0, step, attempt=0))
    first.close()
    again = RunStore(tmp_path)  # the restart resumed from step 3's checkpoint
    for step in range(3, 7):
        again.add_step(rec(0, step, attempt=1, loss=9.0))
    again.add_step(rec(0, 6, attempt=1, loss=8.0))  # the same attempt again: replaced, not kept
    again.close()
    steps = load_steps(tmp_path)
    assert steps[["step", "attempt"]].values.tolist() == [
        [0, 0],
        [1, 0],
        [2, 0],
        [3, 1],
        [4, 1],
        [5, 1],
        [6, 1],
    ]
    assert steps["loss"].iloc[-1] == 8.0
    kept = load_retried_steps(tmp_path)
    assert kept[["step", "attempt"]].values.tolist() == [[3, 0], [4, 0]]
    assert kept["loss"].tolist() == [0.25, 0.2]  # the first attempt's own figures


def test_a_store_from_before_attempts_is_migrated_in_place(tmp_path):
    path = store_path(tmp_path)
    old = sqlite3.connect(path)  # a version-2 store: steps without `attempt`, no steps_retried
    old.execute(
        "CREATE TABLE steps (run_id TEXT, rank INTEGER, world_size INTEGER, step INTEGER, "
        "time REAL, step_s REAL, PRIMARY KEY (rank, step))"
    )
    old.execute("INSERT INTO steps VALUES ('r', 0, 1, 0, 0.0, 0.5)")
    old.execute("PRAGMA user_version=2")
    old.commit()
    old.close()
    assert load_retried_steps(tmp_path).empty  # a reader of an old store finds none kept
    again = RunStore(tmp_path)
    again.add_step(rec(0, 0, attempt=1))
    again.close()
    assert load_steps(tmp_path)["attempt"].tolist() == [1]
    assert load_retried_steps(tmp_path)[["step", "attempt", "step_s"]].values.tolist() == [[0, 0, 0.5]]
