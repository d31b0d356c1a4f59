"""The job store on a real PostgreSQL server: the same store API as SQLite, every node's store
relayed into it exactly once, a leader lock that a survivor takes over, and an outage that costs
one warning and loses nothing."""

from __future__ import annotations

import logging
import math
import multiprocessing
import signal
import subprocess
import sys
import time

import pytest

from fixtures.servers import job_store, store_target
from meshscope.collector import controls
from meshscope.collector.relay import StoreRelay
from meshscope.collector.rundir import job_leader
from meshscope.collector.schema import Event, StepRecord
from meshscope.collector.store import (
    RELAY_TABLES,
    RunStore,
    check_store,
    describe_store,
    insert_events,
    latest_step,
    load_events,
    load_expert_load,
    load_retried_steps,
    load_steps,
    store_path,
    store_version,
)
from meshscope.collector.storedb import StoreUnavailable, locate, pg_connect, write_locator
from meshscope.dashboards import postgres
from tests.conftest import require_binary

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with job_store(tmp_path_factory.mktemp("jobstore")) as running:
        yield running


def _node(tmp_path, server, name: str, job: str):
    """One node's run directory, pointing at the job's store."""
    run = tmp_path / name / job
    write_locator(run, store_target(server, job))
    return run


def _step(rank: int, step: int, **kw) -> StepRecord:
    return StepRecord(run_id="j", rank=rank, world_size=4, step=step, time=time.time(), step_s=0.1, **kw)


def _relay(run, **kw) -> StoreRelay:
    return StoreRelay(store_path(run), locate(run), RELAY_TABLES, **kw)


def test_two_nodes_relay_into_one_job_store_and_either_node_reads_every_rank(tmp_path, server):
    a, b = _node(tmp_path, server, "node0", "job-a"), _node(tmp_path, server, "node1", "job-a")
    writers = [RunStore(a), RunStore(a), RunStore(b), RunStore(b)]  # rank r on node r // 2
    for step in range(6):
        for rank, w in enumerate(writers):
            w.add_step(_step(rank, step, loss=math.nan if step == 2 else 1.0))
    writers[3].add_event(Event(kind="fault", run_id="j", rank=3, step=4, detail={"why": "x"}))
    writers[0].add_expert_load(5, [[1.0, 2.0], [3.0, 4.0]])
    for w in writers:
        w.close()
    assert [_relay(a).drain(), _relay(b).drain()] == [True, True]
    for run in (a, b):
        check_store(run)
        steps = load_steps(run)
        assert sorted(steps["rank"].unique()) == [0, 1, 2, 3]
        assert len(steps) == 24 and steps["loss"].isna().sum() == 4  # NaN reads back as NaN
        assert load_events(run, kind="fault")["detail"].iloc[0] == {"why": "x"}
        assert load_expert_load(run)["tokens"].tolist() == [1.0, 2.0, 3.0, 4.0]
        assert latest_step(run, rank=3) == 5
    assert "schema ms_job_a" in describe_store(a) and "password" not in describe_store(a)
    # a step redone by a restart's attempt replaces its row, as on SQLite; the first attempt's
    # row reaches the job store too, kept apart
    again = RunStore(b)
    again.add_step(_step(3, 5, loss=7.0, attempt=1))
    again.close()
    assert _relay(b).drain()  # a relay started afresh goes on where the last one committed
    assert load_steps(a).query("rank == 3 and step == 5")[["loss", "attempt"]].values.tolist() == [[7.0, 1]]
    kept = load_retried_steps(a)
    assert kept[["rank", "step", "attempt", "loss"]].values.tolist() == [[3, 5, 0, 1.0]]
    assert len(load_events(a, kind="fault")) == 1  # and ships nothing twice


def test_a_drain_while_the_relay_ships_in_its_thread_ships_every_row_once(tmp_path, server):
    # the sidecar drains from the main thread at the end of a run while the relay thread ships
    run = _node(tmp_path, server, "node0", "job-race")
    writer = RunStore(run)
    relay = _relay(run, interval_s=0.001).start()
    for step in range(300):
        writer.add_step(_step(0, step))
        if step % 10 == 0:
            writer.flush()
            assert relay.drain()
    writer.close()
    assert relay.stop()
    steps = load_steps(run)
    assert len(steps) == 300 and steps["step"].is_unique


def test_jobs_on_one_server_do_not_see_each_other(tmp_path, server):
    one, two = _node(tmp_path, server, "n", "job-one"), _node(tmp_path, server, "n", "job-two")
    w = RunStore(one)
    w.add_step(_step(0, 0))
    w.close()
    _relay(one).drain()
    assert len(load_steps(one)) == 1
    with pytest.raises(FileNotFoundError):  # job-two's schema is not there yet
        load_steps(two)


def test_ids_controls_and_the_version_key_work_on_the_job_store(tmp_path, server):
    run = _node(tmp_path, server, "n", "job-ids")
    first, second = insert_events(run, [Event(kind="info", run_id="j", detail={"n": n}) for n in (1, 2)])
    assert second == first + 1
    before = store_version(run)
    change = controls.ControlChange(kind="aux_loss_coef", values=[0.02])
    cid = controls.submit(run, change)
    assert [i for i, _ in controls.pending(run)] == [cid]
    controls.settle(run, cid, status="applied", step=3, old=0.01, new=0.02)
    assert controls.pending(run) == []
    assert controls.load_controls(run)["new"].tolist() == [0.02]
    assert store_version(run) != before


def _migrate(url: str, schema: str, password_file: str) -> None:
    from meshscope.collector.storedb import StoreTarget

    pg_connect(StoreTarget(url, schema, password_file), create=True).close()


def test_every_rank_of_every_node_may_create_the_schema_at_once(tmp_path, server):
    target = store_target(server, "job-race")
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_migrate, args=(target.url, target.schema, target.password_file)) for _ in range(6)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 6
    with pg_connect(target) as conn:  # one migration recorded: versioned, applied once
        assert conn.execute("SELECT count(*) FROM schema_version").fetchone()[0] == 1


HOLDER = """
import sys, time
from meshscope.collector.rundir import job_leader
lock = job_leader(sys.argv[1])
print("held" if lock.held() else "free", flush=True)
time.sleep(600)
"""


def test_the_detection_leader_is_one_process_and_a_survivor_takes_over(tmp_path, server):
    run_a, run_b = _node(tmp_path, server, "node0", "job-lead"), _node(tmp_path, server, "node1", "job-lead")
    # another node (no shared file system: a run folder of its own) holds the job's lock
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_a)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        survivor = job_leader(run_b)
        assert not survivor.held()
        holder.send_signal(signal.SIGKILL)  # the leader's node dies: the server frees its lock
        holder.wait(10)
        deadline = time.monotonic() + 10
        while not survivor.held():
            assert time.monotonic() < deadline, "the lock was not freed when its holder died"
            time.sleep(0.1)
        assert not job_leader(run_a).held()  # and now only the survivor judges
        survivor.release()
    finally:
        holder.kill()


def test_a_job_store_that_goes_down_costs_one_warning_and_loses_nothing(tmp_path, caplog):
    with job_store(tmp_path) as down_then_up:
        run = _node(tmp_path, down_then_up, "n", "job-outage")
        writer = RunStore(run, flush_interval_s=0.05)
        relay = _relay(run, interval_s=0.05).start()
        for step in range(5):
            writer.add_step(_step(0, step))
        writer.add_event(Event(kind="info", run_id="j", step=0, detail={}))
        writer.flush()
        wait = time.monotonic() + 10
        while latest_step(run) < 4:
            assert time.monotonic() < wait
            time.sleep(0.05)
        postgres.stop(down_then_up.home)
        with caplog.at_level(logging.WARNING, logger="meshscope.relay"):
            for step in range(5, 40):  # training goes on: the rows wait on the node's disk
                writer.add_step(_step(0, step))
                writer.add_event(Event(kind="info", run_id="j", step=step, detail={}))
                time.sleep(0.01)
            writer.close()
            time.sleep(0.5)  # several relay rounds against a server that is down
            postgres.start(down_then_up.home, down_then_up.port)
            postgres.wait_ready(down_then_up)
            assert relay.stop()
        assert load_steps(run)["step"].tolist() == list(range(40))
        assert load_events(run, kind="info")["step"].tolist() == [0, *range(5, 40)]  # each once
        outages = [r for r in caplog.records if "wait in" in r.getMessage()]
        assert len(outages) == 1, [r.getMessage() for r in caplog.records]


def test_on_one_node_the_job_is_judged_by_the_directory_lock_this_process_holds(tmp_path):
    from meshscope.collector.rundir import LeaderLock

    directory = LeaderLock(tmp_path)
    assert directory.held()
    assert job_leader(tmp_path, directory).held()  # the same lock: not refused by our own flock
    assert not job_leader(tmp_path).held()  # a second flock of the file is (another agent)


def test_training_goes_on_through_a_job_store_outage_and_every_row_arrives_once(tmp_path):
    """The server stops mid-run for longer than several control polls and relay rounds: the
    ranks never wait on it or die with it (they read their node's file), and once it is back
    every step and event is in the job store once."""
    from fixtures.runs import start_run

    with job_store(tmp_path) as server:
        target = store_target(server, "outage")
        proc = start_run(
            tmp_path,
            "outage",
            None,
            *("--nproc", "2", "--steps", "400", "--set", "control_every=2"),
            *("--store", target.url, "--store-password-file", target.password_file),
        )
        run = tmp_path / "outage"
        try:
            wait = time.monotonic() + 120
            while not (run / "store.json").exists() or latest_step(run) < 5:
                assert proc.poll() is None and time.monotonic() < wait, proc.stdout.read()[-3000:]
                time.sleep(0.2)
            postgres.stop(server.home)
            time.sleep(6)  # polls every 2 steps: dozens of them against a server that is down
            assert proc.poll() is None, "training stopped with the job store: " + proc.stdout.read()[-3000:]
            postgres.start(server.home, server.port)
            postgres.wait_ready(server)
            out, _ = proc.communicate(timeout=300)
        finally:
            proc.kill()
        assert proc.returncode == 0, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        said = [line for line in out.splitlines() if "does not answer" in line or "connection failed" in line]
        assert len(said) <= 1, said  # one warning for the outage, whoever noticed it
        steps = load_steps(run)
        every = list(range(400))
        assert steps.groupby("rank")["step"].apply(list).to_dict() == {0: every, 1: every}
        _every_node_row_is_in_the_job_store_once(run)


def _every_node_row_is_in_the_job_store_once(run) -> None:
    """The node's own file is the truth the relay ships: each of its steps and events is in
    the job store exactly once (its key makes a second copy of the same row impossible, so the
    test counts rows that could differ: none lost, none shipped as another)."""
    import collections
    import sqlite3

    node = sqlite3.connect(store_path(run))
    try:
        node_steps = node.execute("SELECT rank, step FROM steps").fetchall()
        sql = "SELECT kind, COALESCE(rank, -1), COALESCE(step, -1), time FROM events"
        node_events = node.execute(sql).fetchall()
    finally:
        node.close()
    steps = load_steps(run)
    assert sorted(node_steps) == sorted(zip(steps["rank"], steps["step"])), "steps differ from the node's"
    events = load_events(run)
    stored = collections.Counter(
        zip(
            events["kind"],
            events["rank"].fillna(-1).astype(int),
            events["step"].fillna(-1).astype(int),
            events["time"],
            strict=True,
        )
    )
    assert node_events and len(node_steps) == 800
    missing_or_twice = {key: stored[key] for key in node_events if stored[key] != 1}
    assert not missing_or_twice, missing_or_twice


def test_a_round_whose_commit_landed_but_whose_reply_was_lost_is_not_stored_twice(tmp_path, server):
    """The server committed the rows and the positions; the relay saw an error. The next round
    reads the positions back and ships nothing again (reproduced in the relay's own round)."""
    import psycopg

    run = _node(tmp_path, server, "n", "job-lost-reply")
    writer = RunStore(run, flush_interval_s=0.05)
    for step in range(5):
        writer.add_step(_step(0, step))
        writer.add_event(Event(kind="info", run_id="j", step=step, detail={"n": step}))
    writer.close()
    relay = _relay(run)
    lost = {"once": True}

    def reply_lost(conn):  # after the commit: as if the connection broke before the reply
        if lost.pop("once", False):
            raise psycopg.OperationalError("server closed the connection unexpectedly")

    relay._release = reply_lost
    with pytest.raises(StoreUnavailable):
        relay.ship_once()
    assert relay.drain()
    assert load_events(run, kind="info")["step"].tolist() == list(range(5))
    # a second shipper of the same file (another name for it) adds nothing either
    other = _relay(run)
    other.source = "another-name-for-the-same-file"
    assert other.drain()
    assert load_events(run, kind="info")["step"].tolist() == list(range(5))
    assert load_steps(run)["step"].tolist() == list(range(5))


def test_a_job_store_serving_tls_is_reached_over_it_and_its_url_says_how(tmp_path):
    """`stack up --store-tls CERT,KEY`: the server serves TLS, the URL it gives runs verifies
    the server by that certificate, and every reader and the relay talk over TLS."""
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    subj = ["-subj", "/CN=meshscope-store", "-days", "1", "-nodes"]
    openssl = [require_binary("openssl"), "req", "-x509", "-newkey", "rsa:2048", *subj]
    subprocess.run([*openssl, "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    with job_store(tmp_path, tls=(cert, key)) as server:
        assert "sslmode=verify-ca" in server.url and str(server.certificate) in server.url
        run = _node(tmp_path, server, "n", "job-tls")
        writer = RunStore(run)
        writer.add_step(_step(0, 0))
        writer.close()
        assert _relay(run).drain()
        assert load_steps(run)["step"].tolist() == [0]
        with pg_connect(locate(run)) as conn:
            assert conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone()[0]
