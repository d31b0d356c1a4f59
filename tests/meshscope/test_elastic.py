"""Failures for real: kill -9 and resume bit for bit, shrink to fewer agents, every injection."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fixtures.ports import free_port_range
from fixtures.runs import REPO, TINY, start_run
from meshscope.collector.store import (
    latest_step,
    load_events,
    load_expert_load,
    load_retried_steps,
    load_steps,
)
from meshscope.config import load_config
from meshscope.trainer.model import MoELM


def meshscope_run(root, run_id, *flags, port=None):
    """`meshscope run` in its own session (the test kills whole process trees)."""
    return start_run(root, run_id, port, *flags, new_session=True)


def final_params(run_dir):
    cfg = load_config(TINY)
    state = {"model": MoELM(cfg.model).state_dict()}
    newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    dcp.load(state, checkpoint_id=str(newest))
    return newest.name, state["model"]


@pytest.mark.parametrize("layout", [(), ("--set", "parallel.ep=2")], ids=["replicated", "expert-parallel"])
def test_kill9_of_a_worker_resumes_and_ends_bit_identical(tmp_path, monkeypatch, layout):
    """Expert-parallel: each rank holds half the experts, so the resume restores them from
    their shards (the final checkpoint reads back whole, every expert once)."""
    flags = ("--steps", "40", "--checkpoint-every", "5", "--max-restarts", "2", *layout)
    clean = meshscope_run(tmp_path, "clean", *flags)
    out_clean, _ = clean.communicate(timeout=240)
    killed = meshscope_run(tmp_path, "killed", *flags, "--inject", "kill@step=17,rank=1")
    out_killed, _ = killed.communicate(timeout=240)
    assert clean.returncode == 0, out_clean
    assert killed.returncode == 0, out_killed
    events = load_events(tmp_path / "killed")
    kinds = list(events["kind"])
    for kind in ("injected", "fault", "restart", "resume"):
        assert kind in kinds, kinds
    saves = events[(events["kind"] == "checkpoint") & (events["rank"] == 0)]  # on the timeline
    assert len(saves) >= 2 and all(d["held_s"] >= 0 for d in saves["detail"]), saves
    fault = events[events["kind"] == "fault"].iloc[0]["detail"]
    assert fault["rank"] == 1 and fault["type"] == "dead_rank"
    resume = events[events["kind"] == "resume"].iloc[0]["detail"]
    # the step-15 checkpoint is written in the background: if the kill at 17 beat it, the
    # previous complete one (10) is used; either way nothing past the kill point is lost
    assert resume["from_step"] in (10, 15)
    assert resume["steps_lost"] == 17 - resume["from_step"]
    steps = load_steps(tmp_path / "killed")
    assert sorted(steps["step"].unique()) == list(range(40))
    _where_the_time_went(tmp_path, out_clean, out_killed)
    _the_first_attempt_is_kept(tmp_path / "killed", steps, resume["from_step"], monkeypatch)
    name_a, a = final_params(tmp_path / "clean")
    name_b, b = final_params(tmp_path / "killed")
    assert name_a == name_b == "step_00000040"
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _where_the_time_went(root, out_clean: str, out_killed: str) -> None:
    """The kill's cost is in its run's account (the steps redone, the restart), not in the
    clean twin's; each rank's buckets add up to the wall time; the summaries say so."""
    from meshscope.collector.report import efficiency

    clean, killed = (efficiency(root / name)["account"] for name in ("clean", "killed"))
    for account in (clean, killed):
        for rank, buckets in account.ranks.items():
            assert sum(buckets.values()) == pytest.approx(account.wall_s), rank
    assert killed.job["wasted_progress"] > 0 and killed.job["restart"] > 0, killed.job
    assert clean.job["wasted_progress"] == 0 == clean.job["restart"], clean.job
    assert killed.ettr < clean.ettr
    for out in (out_clean, out_killed):
        assert "where the time went: ETTR" in out and "maturity: L" in out, out[-2000:]
    assert "maturity: L4" in out_killed or "maturity: L5" in out_killed, out_killed[-1500:]  # it resumed


def test_a_kill_inside_an_approved_re_placement_resumes_bit_identical(tmp_path):
    """Expert parallelism with fp16 compression and three changes approved before the start
    (a router bias, a re-placement, a capacity factor: one per control poll). Rank 1 dies
    inside the re-placement, after the experts travelled and before the job agreed; the
    restart resumes from the checkpoint before it, the re-placement lands again at its own
    step, and every tensor of the final checkpoint and of each rank's local state (RNG, the
    changes' values, the drifted router bias) equals the uninterrupted run's."""
    from fixtures.resume import differences, final_checkpoint, queue_changes

    changes = [
        ("router_bias", 0, [0.01, 0.0, 0.0, 0.0, 0.0]),
        ("expert_placement", 1, [2, 1, 0, 3]),  # experts 0 and 2 change rank
        ("capacity_factor", -1, [2.0]),
    ]
    flags = ("--steps", "20", "--checkpoint-every", "5", "--max-restarts", "2", "--set", "control_every=5")
    flags += ("--set", "parallel.ep=2", "--set", "train.compression=fp16")
    runs = {}
    for name, extra in (("clean", ()), ("killed", ("--inject", "kill@step=6,rank=1,during=move"))):
        queue_changes(tmp_path / name, changes)
        proc = meshscope_run(tmp_path, name, *flags, *extra)
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out[-3000:]
        runs[name] = load_events(tmp_path / name)
    kinds = list(runs["killed"]["kind"])
    assert {"injected", "restart", "resume"} <= set(kinds), kinds
    for events in runs.values():  # each change applied once, at its poll (the move at step 10)
        settled = events[events["kind"] == "suggestion_applied"]
        fates = [(d["status"], int(s)) for s, d in zip(settled["step"], settled["detail"])]
        assert fates == [("applied", 5), ("applied", 10), ("applied", 15)], fates
    moved = settled["detail"].iloc[1]["new"]["1"]
    assert moved["moved"] == [0, 2] and moved["placement"] == [2, 1, 0, 3], moved
    assert not differences(final_checkpoint(tmp_path / "clean"), final_checkpoint(tmp_path / "killed"))


def _the_first_attempt_is_kept(run_dir, steps, from_step, monkeypatch):
    """The steps the restart redid keep the killed attempt's rows beside the redo's, in the store
    and on the view's Run page."""
    import json

    from streamlit.testing.v1 import AppTest

    retried = load_retried_steps(run_dir)
    assert set(retried["attempt"]) == {0}
    for rank in (0, 1):  # what both ranks completed after the checkpoint and before the kill
        assert sorted(retried[retried["rank"] == rank]["step"]) == list(range(from_step, 17)), retried
    redone = steps.merge(retried[["rank", "step"]], on=["rank", "step"])
    assert len(redone) == len(retried) and set(redone["attempt"]) == {1}
    assert set(steps[steps["step"] < from_step]["attempt"]) == {0}
    monkeypatch.setenv("MESHSCOPE_VIEW_RUNS_DIR", str(run_dir.parent))
    at = AppTest.from_file(str(REPO / "view" / "app.py"), default_timeout=60)
    at.query_params["run"] = run_dir.name
    at.run()
    at.switch_page("screens/run.py").run()
    assert not at.exception, [e.value for e in at.exception]
    charts = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]
    assert "step time per attempt (s)" in charts
    assert any("ran in 2 attempts" in c.value for c in at.caption)


def _descendants(pid):
    kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(k) for k in kids] + [d for k in kids for d in _descendants(int(k))]


def _both_nodes_trained(run_dir, steps_together):
    """Whether ranks 0 and 1 of a 2-agent world have each taken `steps_together` steps (past a
    checkpoint or two, so the shrink resumes from one the two-agent world wrote)."""
    if latest_step(run_dir, rank=None) < steps_together:  # tolerates a store not there yet
        return False
    steps = load_steps(run_dir)
    together = steps[steps["world_size"] == 2].groupby("rank")["step"].nunique()
    return set(together.index) == {0, 1} and together.min() >= steps_together


def test_the_rendezvous_store_listens_only_where_it_is_told():
    """It holds heartbeats, verdicts and stacks, unauthenticated: `--host 127.0.0.1` must not
    listen on every interface (TCPStore alone would)."""
    port = free_port_range(1)
    store = subprocess.Popen(
        [sys.executable, "-m", "meshscope", "rendezvous", "--host", "127.0.0.1", "--port", str(port)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert f"listening on 127.0.0.1:{port}" in store.stdout.readline()
        listening = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True).stdout
    finally:
        store.terminate()
        store.wait(timeout=30)
    assert [line.split()[3] for line in listening.splitlines()] == [f"127.0.0.1:{port}"], listening


def test_shrink_when_an_agent_dies_for_good(tmp_path):
    rdzv = free_port_range(1)
    store = subprocess.Popen(
        [sys.executable, "-m", "meshscope", "rendezvous", "--port", str(rdzv)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert "rendezvous store" in store.stdout.readline()
        flags = (
            "--nproc",
            "1",
            "--steps",
            "300",
            "--nnodes",
            "1:2",
            "--rdzv-endpoint",
            f"127.0.0.1:{rdzv}",
            "--rdzv-external",
            "--max-restarts",
            "3",
            "--checkpoint-every",
            "5",
            # the second agent's start may take seconds here: the first waits for it (a full
            # world completes the rendezvous at once, so this costs nothing when it is on time)
            "--set",
            "elastic.last_call_s=10",
        )
        survivor = meshscope_run(tmp_path, "elastic", *flags)
        time.sleep(0.5)
        doomed = meshscope_run(tmp_path, "elastic", *flags)
        # a busy machine may start the second agent after the first's last call: it then joins
        # by a re-rendezvous, so wait for steps that both nodes took before killing one
        deadline = time.monotonic() + 150
        while not _both_nodes_trained(tmp_path / "elastic", 15) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _both_nodes_trained(tmp_path / "elastic", 15), "the two agents never trained together"
        for pid in [doomed.pid] + _descendants(doomed.pid):  # the whole node goes, workers too
            os.kill(pid, signal.SIGKILL)
        out, _ = survivor.communicate(timeout=240)
        assert survivor.returncode == 0, out
    finally:
        store.kill()
    steps = load_steps(tmp_path / "elastic")
    assert set(steps[steps["world_size"] == 2]["rank"]) == {0, 1}
    after = steps[steps["world_size"] == 1]
    assert after["step"].max() == 299 and set(after["rank"]) == {0}
    events = load_events(tmp_path / "elastic")
    resume = events[events["kind"] == "resume"].iloc[-1]["detail"]
    assert (resume["world_size_then"], resume["world_size_now"]) == (2, 1)
    assert "fault" in set(events["kind"])


@pytest.fixture(scope="module")
def injected(tmp_path_factory):
    root = tmp_path_factory.mktemp("inject")
    proc = meshscope_run(
        root,
        "all",
        "--steps",
        "40",
        "--inject",
        "slow@step=5,rank=1,steps=5,factor=3",
        "--inject",
        "comm_delay@step=12,rank=0,steps=3,ms=40",
        "--inject",
        "nan@step=17,rank=1",
        "--inject",
        "expert_collapse@step=20,rank=0,steps=10,layer=0",
        "--inject",
        "memory_leak@step=25,rank=1,steps=10,mb_per_step=8",
        "--inject",
        "hang@step=36,rank=0,seconds=2",
    )
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    run = root / "all"
    steps = load_steps(run)
    return {
        "dir": run,
        "steps": steps,
        "rank": {r: steps[steps["rank"] == r].set_index("step") for r in (0, 1)},
        "events": load_events(run),
        "experts": load_expert_load(run),
    }


def test_every_injection_is_ground_truth_in_the_store(injected):
    inj = injected["events"][injected["events"]["kind"] == "injected"]
    got = sorted((d["kind"], d["rank"], d["start_step"]) for d in inj["detail"])
    assert got == sorted(
        [
            ("slow", 1, 5),
            ("comm_delay", 0, 12),
            ("nan", 1, 17),
            ("expert_collapse", 0, 20),
            ("memory_leak", 1, 25),
            ("hang", 0, 36),
        ]
    )


def test_slow_rank_step_time_rises_by_about_its_factor(injected):
    r1 = injected["rank"][1]["step_s"]
    before, during = r1.loc[1:4].median(), r1.loc[5:9].median()
    assert 2.2 < during / before < 4.5


def test_comm_delay_shows_as_communication(injected):
    r0 = injected["rank"][0]
    assert r0.loc[12:14, "comm_exposed_s"].min() > 0.03 > r0.loc[15:19, "comm_exposed_s"].median()


def test_nan_gives_a_non_finite_loss_event_and_training_goes_on(injected):
    nan_events = injected["events"][injected["events"]["kind"] == "nan"]
    assert list(zip(nan_events["rank"], nan_events["step"])) == [(1, 17)]
    r1 = injected["rank"][1]["loss"]
    assert r1.loc[18:].notna().all() and r1.loc[39] < r1.loc[16]  # the bad step was skipped


def test_expert_collapse_moves_the_expert_load(injected):
    e = injected["experts"]
    layer0 = e[e["layer"] == 0].pivot(index="step", columns="expert", values="tokens")
    share = layer0[0] / layer0.sum(axis=1)
    assert share.loc[[24, 29]].min() > 1.5 * share.loc[[9, 14, 34, 39]].max()


def test_memory_leak_grows_rss_by_its_rate(injected):
    rss = injected["rank"][1]["mem_rss"]
    growth_mb = (rss.loc[34] - rss.loc[24]) / 2**20
    assert 70 < growth_mb < 100  # 10 steps x 8 MB


def test_hang_stalls_the_peers_collective(injected):
    assert injected["rank"][1].loc[36, "step_s"] > 1.5


def test_the_time_account_adds_up_and_the_slow_rank_made_the_other_wait(injected):
    from meshscope.collector.report import efficiency

    account = efficiency(injected["dir"])["account"]
    for rank, buckets in account.ranks.items():
        assert sum(buckets.values()) == pytest.approx(account.wall_s), rank
    waited = {rank: buckets["straggler"] for rank, buckets in account.ranks.items()}
    assert waited[0] > 2 * waited[1], waited  # rank 1 computed 3x for 5 steps: rank 0 waited


def test_detect_finds_the_injected_faults_afterwards(injected):
    from typer.testing import CliRunner

    from meshscope.cli import app

    result = CliRunner().invoke(app, ["detect", "--run", str(injected["dir"])])
    assert result.exit_code == 0, result.output
    anomalies = load_events(injected["dir"], kind="anomaly")["detail"].tolist()
    found = {(a["type"], tuple(a["ranks"])) for a in anomalies}
    assert ("nan", (1,)) in found and ("memory", (1,)) in found
    collapse = [a for a in anomalies if a["type"] == "expert_imbalance" and a.get("layer") == 0]
    assert collapse and collapse[0]["expert"] == 0 and collapse[0]["start_step"] <= 29
    assert all(set(a) >= {"score", "start_step", "end_step", "evidence"} for a in anomalies)
    again = CliRunner().invoke(app, ["detect", "--run", str(injected["dir"])])
    assert again.exit_code == 0, again.output
    assert len(load_events(injected["dir"], kind="anomaly")) == len(anomalies)  # idempotent


def test_grow_admits_a_returning_agent(tmp_path):
    rdzv = free_port_range(1)
    store = subprocess.Popen(
        [sys.executable, "-m", "meshscope", "rendezvous", "--port", str(rdzv)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    flags = (
        "--nproc",
        "1",
        "--steps",
        "5000",
        "--nnodes",
        "1:2",
        "--rdzv-endpoint",
        f"127.0.0.1:{rdzv}",
        "--rdzv-external",
        "--max-restarts",
        "5",
        "--checkpoint-every",
        "10",
    )
    agents = []
    run = tmp_path / "grow"

    def steps_at(world):
        try:
            s = load_steps(run)
        except FileNotFoundError:
            return None
        return s[s["world_size"] == world]

    try:
        assert "rendezvous store" in store.stdout.readline()
        agents.append(meshscope_run(tmp_path, "grow", *flags))
        deadline = time.monotonic() + 120
        while (s := steps_at(1)) is None or len(s) < 20:  # alone first: world size 1
            assert time.monotonic() < deadline, "the first agent never trained alone"
            time.sleep(0.2)
        agents.append(meshscope_run(tmp_path, "grow", *flags))  # a node comes (back)
        deadline = time.monotonic() + 120
        while (s := steps_at(2)) is None or s["rank"].nunique() < 2 or len(s) < 20:
            assert time.monotonic() < deadline, "the newcomer was never admitted"
            time.sleep(0.2)
    finally:
        for proc in agents:
            for pid in [proc.pid] + _descendants(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        store.kill()
    grown = steps_at(2)
    assert grown["step"].min() > steps_at(1)["step"].min()  # resumed from a checkpoint, not 0
    resumes = load_events(run, kind="resume")["detail"].tolist()
    assert any((r["world_size_then"], r["world_size_now"]) == (1, 2) for r in resumes)
    # a membership change is no failure: nobody is named dead (stale keys of old rounds ignored)
    assert load_events(run, kind="fault").empty
