"""The hang watchdog names the culprit rank and collective, on real gloo ranks."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures.dist import rank_context
from fixtures.hang_cases import BACKENDS, FAULT_STEP, rank_main
from fixtures.ports import free_port_range
from meshscope.watchdog.config import HangConfig
from meshscope.watchdog.watch import HangWatch

WORLD = 3
CULPRIT = WORLD - 1


def watch_scenario(
    tmp_path: Path,
    scenario: str,
    timeout_s: float = 45.0,
    world: int = WORLD,
    backend: str = "gloo",
    recorder: bool = False,
):
    """Run the scenario on `world` ranks and return the diagnosis (None: none came)."""
    live = tmp_path / "live"
    ctx = rank_context()
    port = free_port_range(1)
    kwargs = {"backend": backend, "recorder": recorder}
    procs = [
        ctx.Process(target=rank_main, args=(r, world, port, str(live), scenario), kwargs=kwargs)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    watch = HangWatch(live, HangConfig(min_stall_s=1.5, poll_s=0.1, stacks_wait_s=1.0))
    diag, deadline = None, time.monotonic() + timeout_s
    try:
        while diag is None and time.monotonic() < deadline:
            if all(p.exitcode is not None for p in procs) and scenario == "clean":
                break
            diag = watch.poll()
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    return diag


@pytest.mark.parametrize(
    "scenario,kind",
    [
        ("skip", "desync"),
        ("compute", "compute"),
        ("op", "mismatch"),
        ("shape", "mismatch"),
        ("dtype", "mismatch"),
        ("split", "mismatch"),
        ("kill", "dead"),
        ("error", "error"),
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_names_the_culprit_rank_and_collective(tmp_path, scenario, kind, backend):
    diag = watch_scenario(tmp_path, scenario, backend=backend)
    assert diag is not None, f"{scenario}: no diagnosis"
    detail = diag.detail()
    assert detail["source"] == ("host" if backend == "gloo" else "device events"), detail
    assert detail["culprit_ranks"] == [CULPRIT], detail["why"]
    assert detail["type"] == kind, detail["why"]
    assert detail["why"] and str(CULPRIT) in detail["why"]
    if kind in ("desync", "compute", "mismatch"):
        assert detail["seq"] == FAULT_STEP and detail["group"] is not None, detail
        assert detail["op"] in ("all_reduce", "broadcast", "all_to_all_single"), detail
        assert CULPRIT not in detail["waiting_ranks"]


@pytest.mark.parametrize("scenario", ["shape", "dtype"])
def test_two_ranks_without_a_majority_the_one_that_changed_is_blamed(tmp_path, scenario):
    # No majority to outvote it: the culprit is the rank whose collective differs from what it
    # issued at the same place of the previous step.
    diag = watch_scenario(tmp_path, scenario, world=2)
    assert diag is not None and diag.kind == "mismatch"
    assert diag.culprit_ranks == [1], diag.why


def test_a_rank_in_compute_is_located_by_its_stack(tmp_path):
    diag = watch_scenario(tmp_path, "compute")
    assert "hang_cases.py" in diag.why and "_compute" in diag.why, diag.why
    assert diag.waiting_ranks == [0, 1]
    assert any("_compute" in line for line in diag.stacks[CULPRIT])


def test_the_backends_own_flight_recorder_is_dumped_on_demand_and_read_like_a_post_mortem(tmp_path):
    # PyTorch's recorder on: the watchdog's stack request also makes every live rank dump it
    diag = watch_scenario(tmp_path, "compute", recorder=True)
    assert diag is not None and diag.kind == "compute" and diag.culprit_ranks == [CULPRIT], diag.why
    recorded = diag.evidence["flight_recorder"]
    assert recorded["ranks"] == list(range(WORLD)), recorded
    assert recorded["culprit_ranks"] == [CULPRIT] and recorded["type"] == "missing", recorded
    assert recorded["op"] == "all_reduce" and recorded["seq"] == FAULT_STEP + 1, recorded  # it counts from 1


def test_a_clean_run_is_not_a_hang(tmp_path):
    assert watch_scenario(tmp_path, "clean", timeout_s=20) is None


@pytest.mark.parametrize(
    "scenario,kind,op",
    [
        ("missing", "missing", "all_reduce"),
        ("all_to_all", "missing", "all_to_all"),
        ("op", "mismatch", "broadcast"),
    ],
)
def test_flight_recorder_dumps_of_a_plain_job_are_diagnosed(tmp_path, scenario, kind, op):
    from fixtures.hang_cases import fr_rank_main
    from meshscope.watchdog.flight_recorder import diagnose_dumps

    ctx = rank_context()
    port = free_port_range(1)
    procs = [
        ctx.Process(target=fr_rank_main, args=(r, WORLD, port, str(tmp_path), scenario)) for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    diag = diagnose_dumps(tmp_path, prefix="rank")
    assert diag.culprit_ranks == [CULPRIT] and diag.kind == kind, diag.why
    assert diag.op == op and diag.seq == FAULT_STEP + 1  # PyTorch counts from 1
    if scenario == "missing":  # and as a person would ask
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "meshscope",
                "hang-report",
                "--flight-recorder",
                str(tmp_path),
                "--prefix",
                "rank",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and "never entered all_reduce #4" in " ".join(out.stdout.split())


def test_hostile_or_foreign_dumps_are_refused(tmp_path):
    import pickle

    from meshscope.watchdog.flight_recorder import DumpError, diagnose_dumps

    class Boom:
        def __reduce__(self):
            return (print, ("this must never run",))

    (tmp_path / "rank0").write_bytes(pickle.dumps({"entries": [Boom()]}))
    with pytest.raises(DumpError, match="refusing to load builtins.print"):
        diagnose_dumps(tmp_path)
    (tmp_path / "rank0").write_bytes(b"\x00garbage")
    with pytest.raises(DumpError, match="not a Flight Recorder dump"):
        diagnose_dumps(tmp_path)
    (tmp_path / "rank0").write_text('{"version": "2.10"}')
    with pytest.raises(DumpError, match="no 'entries' list"):
        diagnose_dumps(tmp_path)


def test_the_threshold_follows_the_step_time_and_a_new_stall_is_judged_anew(tmp_path):
    from meshscope.collector.flightlog import FlightLog

    logs = [FlightLog(tmp_path, rank=r, world_size=2) for r in range(2)]
    now = [time.time()]
    seen = []
    watch = HangWatch(
        tmp_path,
        HangConfig(min_stall_s=1.0, step_factor=10.0, stacks_wait_s=0.05),
        on_hang=seen.append,
        clock=lambda: now[0],
    )
    assert watch.poll() is None  # no step yet: the startup allowance (120 s) applies

    def steps(seconds):
        for log in logs:
            log.step_begin(0)
            log._step_started -= seconds  # as if the step took this long
            log.step_end()
        now[0] = time.time()

    steps(0.5)  # typical step 0.5 s: a hang is 10 x 0.5 = 5 s without progress
    now[0] += 4.0
    assert watch.poll() is None
    now[0] += 1.5
    first = watch.poll()
    assert first is not None and first.kind == "compute" and seen == [first]
    now[0] += 10
    assert watch.poll() is None  # the same stall is reported once
    steps(0.5)  # progress resumed, then stops again
    now[0] += 6
    assert watch.poll() is not None and len(seen) == 2
    for log in logs:
        log.close()
    now[0] += 60
    assert watch.poll() is None  # a clean end is no hang


def test_nodes_share_flight_logs_through_the_store_to_name_a_remote_culprit(tmp_path):
    """Ranks 0-1 on node A, rank 2 on node B (two run directories, as two machines have): A's
    watchdog (the job's judge) sees its ranks stall, asks B through the store and names rank 2;
    B's watchdog does not ask anyone: it acts on A's verdict, for its own ranks only."""
    import torch.distributed as dist

    from meshscope.watchdog.exchange import NodeExchange

    port = free_port_range(2)
    store_port = port + 1
    master = dist.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)
    client = lambda: dist.TCPStore("127.0.0.1", store_port, is_master=False)  # noqa: E731
    dirs = {0: tmp_path / "a", 1: tmp_path / "a", 2: tmp_path / "b"}
    ctx = rank_context()
    procs = [
        ctx.Process(target=rank_main, args=(r, WORLD, port, str(dirs[r]), "compute")) for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    config = HangConfig(min_stall_s=1.5, poll_s=0.1, stacks_wait_s=1.0)
    followed: list = []
    node_b = HangWatch(
        tmp_path / "b", config, exchange=NodeExchange(client), judge=lambda: False, on_hang=followed.append
    ).start()
    node_a = HangWatch(tmp_path / "a", config, exchange=NodeExchange(client))
    diag, deadline = None, time.monotonic() + 45
    try:
        while diag is None and time.monotonic() < deadline:
            diag = node_a.poll()
            time.sleep(0.1)
        while not followed and time.monotonic() < deadline:
            time.sleep(0.1)
        requests = master.add("meshscope/hang/requests", 0)
    finally:
        node_b.stop()
        for p in procs:
            p.kill()
            p.join(10)
        del master
    assert diag is not None and diag.culprit_ranks == [CULPRIT] and diag.kind == "compute", diag
    assert diag.seq == FAULT_STEP and "_compute" in diag.why  # B's stack, through the store
    assert diag.waiting_ranks == [0, 1]
    assert [(d.culprit_ranks, d.kind) for d in followed] == [([CULPRIT], "compute")]  # once, A's verdict
    assert set(followed[0].pids) == {"2"}  # B aborts its own rank, never A's pids
    assert requests == 1  # one request for the stall, not one per node


@pytest.mark.parametrize("backend", BACKENDS)
def test_everyone_in_the_collective_but_the_transport_stuck(tmp_path, backend):
    # sim: the culprit's stream stops and every host runs on; gloo: the culprit freezes in the
    # middle of the transfer. Every rank entered all-reduce #FAULT_STEP and none finishes it.
    diag = watch_scenario(tmp_path, "transport", backend=backend)
    assert diag is not None, "transport stuck: no diagnosis"
    assert diag.kind == "stuck", diag.why
    assert diag.culprit_ranks == [] and diag.waiting_ranks == list(range(WORLD)), diag.why
    assert (diag.op, diag.seq) == ("all_reduce", FAULT_STEP), diag.why


def test_a_run_lingering_for_its_last_scrape_is_not_a_hang(tmp_path):
    """After the last step the workers keep /metrics up (`--linger`) and do nothing: the
    watchdog beside the run must not take that quiet for a stall."""
    from fixtures.runs import start_run
    from meshscope.collector.store import load_events

    proc = start_run(tmp_path, "linger", None, "--steps", "5", "--linger", "6", "--hang-after", "1")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-2000:]
    kinds = list(load_events(tmp_path / "linger")["kind"])
    assert "run_end" in kinds and "hang" not in kinds, kinds


def test_ranks_that_lost_a_node_name_the_node_not_themselves(tmp_path):
    """Ranks 0-1 closed with "connection closed by peer" (their peers' node went away); ranks
    2-3 left nothing here and their node answers nobody: they are the culprits, 0-1 victims."""
    from meshscope.collector.flightlog import FlightLog
    from meshscope.collector.flightread import read_flight
    from meshscope.watchdog.diagnose import diagnose

    tails = {}
    for rank in range(2):
        log = FlightLog(tmp_path, rank=rank, world_size=4)
        log.step_begin(21)
        log.note_error(RuntimeError("Connection closed by peer [10.77.0.2]:15249. This is typically"))
        log.close()
        tails[rank] = read_flight(log.path)
    diag = diagnose(tails, 4, alive={0: False, 1: False})
    assert (diag.kind, diag.culprit_ranks, diag.waiting_ranks) == ("dead", [2, 3], [0, 1]), diag.why
    assert "10.77.0.2" in diag.why and "step 21" in diag.why, diag.why
    # a rank of this node killed without a word while its agent tore the attempt down (it did
    # not stop in time on a busy host) is collateral, not the culprit
    torn = FlightLog(tmp_path / "torn", rank=1, world_size=4)
    torn.step_begin(21)
    mixed = {0: tails[0], 1: read_flight(torn.path)}
    diag = diagnose(mixed, 4, alive={0: False, 1: False})
    assert (diag.kind, diag.culprit_ranks, diag.waiting_ranks) == ("dead", [2, 3], [0]), diag.why
    assert "rank 1 here vanished" in diag.why, diag.why
    # with every rank in sight, a lost connection alone names nobody it cannot see
    assert diagnose(tails, 2, alive={0: False, 1: False}).kind != "dead"


def test_ranks_told_to_stop_are_not_hung_on_their_way_out(tmp_path):
    """SIGTERM (the agent restarting the job, the user cancelling): a rank that stalls while
    it stops is leaving on purpose; the same stall without the stop is a hang."""
    from meshscope.collector.flightlog import FlightLog

    logs = [FlightLog(tmp_path, rank=r, world_size=2) for r in range(2)]
    now = [time.time()]
    watch = HangWatch(
        tmp_path, HangConfig(min_stall_s=1.0, step_factor=2.0, stacks_wait_s=0.05), clock=lambda: now[0]
    )
    for log in logs:
        log.step_begin(0)
        log.step_end()
    for log in logs:
        log.stopping()
    now[0] += 30
    assert watch.poll() is None
    # ...and gone before closing its log (its agent's grace ran out): a departure, not a death
    from meshscope.collector.flightread import read_flight
    from meshscope.watchdog.diagnose import diagnose

    gone = diagnose({r: read_flight(log.path) for r, log in enumerate(logs)}, 2, alive={0: False, 1: False})
    assert gone.kind != "dead", gone.why
    import struct

    from meshscope.collector.flightread import RUNNING, STATE_HDR_OFFSET

    for log in logs:  # the same stall, nobody told to stop
        struct.pack_into("<i", log._map, STATE_HDR_OFFSET, RUNNING)
    diag = watch.poll()
    assert diag is not None and diag.kind == "compute", diag
    for log in logs:
        log.close()
