"""Root cause over recorded runs of every injection kind: the injected cause ranked first, on the
right rank where the data can tell; nothing on clean runs; one anomaly explained on its own."""

import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from fixtures.recorded import CAUSES, injected_runs, injection_kind
from fixtures.recorded import STORES as DATA
from fixtures.runs import meshscope
from meshscope.explain.facts import CAUSE_KINDS, RunFacts
from meshscope.explain.ranking import explain


@pytest.mark.parametrize("run", injected_runs(), ids=lambda p: p.name)
def test_the_injected_cause_is_ranked_first(run):
    kind, rank = injection_kind(run)
    want, rank_known = CAUSES[kind]
    causes = explain(run)
    assert causes and causes[0].kind == want, (kind, [(c.kind, c.ranks) for c in causes[:3]])
    assert not rank_known or causes[0].ranks == [rank], (kind, causes[0].ranks)
    for cause in causes:
        assert cause.kind in CAUSE_KINDS and cause.evidence and cause.action, cause
        assert 0 < cause.confidence <= 1


@pytest.mark.parametrize("name", ["clean-a", "clean-b", "clean-c"])
def test_clean_runs_have_nothing_to_explain(name):
    assert explain(DATA / name) == []


def _stored(tmp_path: Path, name: str) -> Path:
    """A recorded run whose anomalies were judged and stored, as a live run has them."""
    run = tmp_path / name
    shutil.copytree(DATA / name, run)
    meshscope("detect", "--run", str(run), check=True)
    return run


def test_one_anomaly_is_explained_by_its_window(tmp_path):
    run = _stored(tmp_path, "expert_collapse-2")
    facts = RunFacts.load(run)
    assert facts.anomalies and all(a.id is not None for a in facts.anomalies)
    imbalance = next(a for a in facts.anomalies if a.type == "expert_imbalance")
    top = explain(facts, imbalance.id)[0]
    assert top.kind == "routing" and imbalance.id in top.anomaly_ids
    with pytest.raises(KeyError, match="anomaly ids"):
        explain(facts, 10**6)


def test_a_nan_inside_an_expert_collapse_is_not_its_first_cause(tmp_path):
    """Another fault in the window (a loss that went NaN later on one rank) moves no expert's
    share: the routing explains the anomaly; the NaN is still the run's own cause."""
    from meshscope.collector.schema import Event
    from meshscope.collector.store import insert_events

    run = _stored(tmp_path, "expert_collapse-2")
    imbalance = next(a for a in RunFacts.load(run).anomalies if a.type == "expert_imbalance")
    nan = {"what": "loss", "value": "nan"}
    later = imbalance.start_step + 3
    insert_events(run, [Event(kind="nan", run_id=run.name, rank=0, step=later, detail=nan)])
    facts = RunFacts.load(run)
    causes = explain(facts, imbalance.id)
    assert causes[0].kind == "routing", [(c.kind, c.confidence) for c in causes]
    assert "nonfinite" in {c.kind for c in explain(facts)}


def test_the_cli_prints_the_ranked_causes_and_refuses_what_is_not_a_run(tmp_path):
    run = _stored(tmp_path, "slow")
    out = meshscope("explain", "--run", str(run), "--json")
    assert out.returncode == 0, out.stderr
    causes = json.loads(out.stdout)
    assert causes[0]["kind"] == "slow_host" and causes[0]["ranks"] == [1]
    from typer.testing import CliRunner

    from meshscope.cli import app

    runner = CliRunner()
    text = runner.invoke(app, ["explain", "--run", str(run)])
    assert "slow_host" in text.output and "next:" in text.output
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "store.sqlite").write_text("not sqlite")
    for args in (
        ["--run", str(tmp_path / "none")],
        ["--run", str(bad)],
        ["--run", str(run), "--anomaly", "999999"],
    ):
        out = runner.invoke(app, ["explain", *args])
        assert out.exit_code == 2 and "error:" in out.output, out.output
    assert sqlite3.connect(run / "store.sqlite").execute("select count(*) from steps").fetchone()


def test_a_checkpoint_that_stalls_the_job_is_the_known_cause(tmp_path):
    from meshscope.collector.schema import Event
    from meshscope.collector.store import RunStore

    run = tmp_path / "ckpt"
    shutil.copytree(DATA / "clean-a", run)
    with sqlite3.connect(run / "store.sqlite") as db:  # every rank waits 0.6 s at step 50
        db.execute(
            "UPDATE steps SET step_s = step_s + 0.6, comm_exposed_s = comm_exposed_s + 0.6 WHERE step = 50"
        )
        ranks = [r for (r,) in db.execute("SELECT DISTINCT rank FROM steps ORDER BY rank")]
    store = RunStore(run)
    store.add_event(
        Event(kind="checkpoint", run_id="r", rank=0, step=50, detail={"saved_step": 50, "held_s": 0.6})
    )
    store.add_event(
        Event(
            kind="anomaly",
            run_id="r",
            rank=0,
            step=50,
            severity="warning",
            detail={"type": "comm", "ranks": ranks, "start_step": 50, "end_step": 50, "score": 1.0},
        )
    )
    store.close()
    causes = explain(run)
    assert causes[0].kind == "checkpoint" and "step 50" in causes[0].title, [
        (c.kind, c.title) for c in causes
    ]
    assert "not a fault" in causes[0].action
    assert all(c.confidence < causes[0].confidence for c in causes[1:])


def test_a_wait_every_rank_sat_through_is_not_pinned_on_a_rank_a_sliver_slower(tmp_path):
    """Both ranks waited 0.3 s in communication at step 60 (a retransmit), and rank 1 computed
    12 ms more there: 1.6x its peer's compute, a sliver of a 0.32 s step. Naming rank 1 for
    its peer's wait would be a wrong culprit."""
    from meshscope.collector.schema import Event
    from meshscope.collector.store import RunStore

    run = tmp_path / "blip"
    shutil.copytree(DATA / "clean-a", run)
    with sqlite3.connect(run / "store.sqlite") as db:
        db.execute(
            "UPDATE steps SET step_s = step_s + 0.3, comm_exposed_s = comm_exposed_s + 0.3 WHERE step = 60"
        )
        db.execute(
            "UPDATE steps SET comm_exposed_s = comm_exposed_s - 0.012, forward_s = forward_s + 0.012"
            " WHERE step = 60 AND rank = 1"
        )
    store = RunStore(run)
    detail = {"type": "stall", "ranks": [0, 1], "start_step": 60, "end_step": 60, "score": 9.0}
    store.add_event(Event(kind="anomaly", run_id="r", rank=0, step=60, severity="warning", detail=detail))
    store.close()
    causes = explain(run)
    assert not any(c.kind == "slow_host" and c.ranks for c in causes), [(c.kind, c.title) for c in causes]


@pytest.mark.parametrize("name", ["skip_collective", "collective_mismatch"])
def test_ranks_the_watchdog_aborted_are_no_second_cause(name):
    causes = explain(DATA / name)
    assert [c.kind for c in causes] == ["hang"], [(c.kind, c.confidence) for c in causes]
    assert any("on purpose" in e for e in causes[0].evidence), causes[0].evidence


def test_no_cause_below_the_confidence_floor_is_shown():
    from meshscope.explain.ranking import MIN_CONFIDENCE

    for run in injected_runs():
        assert all(c.confidence >= MIN_CONFIDENCE for c in explain(run)), run.name


def _expert_parallel(tmp_path: Path, name: str, work_of_rank_1: float) -> Path:
    """A recorded run where rank 1 computes 3x slower from step 80, as if its 2 ranks had
    sharded 4 experts (2 each) and rank 1's experts processed `work_of_rank_1` x rank 0's tokens."""
    import json

    from meshscope.collector.store import RunStore

    run = tmp_path / name
    shutil.copytree(DATA / "slow", run)
    config = {"model": {"experts": 4, "top_k": 2}, "parallel": {"ep": 2}, "expert_every": 5}
    (run / "config.json").write_text(json.dumps(config))
    store = RunStore(run)
    for step in range(4, 150, 5):
        hot = work_of_rank_1 if 80 <= step < 95 else 1.0
        store.add_expert_work(step, 0, [1000.0, 1000.0])
        store.add_expert_work(step, 1, [1000.0, 1000.0 * hot])
    store.close()
    return run


def test_a_rank_slow_from_the_experts_placed_on_it_is_told_from_a_slow_host(tmp_path):
    hot = explain(_expert_parallel(tmp_path, "hot", 2.4))
    assert hot[0].kind == "hot_experts" and hot[0].ranks == [1], [(c.kind, c.confidence) for c in hot]
    assert hot[0].title.startswith("rank 1 is slow in layer 1 because experts 2 and 3, placed on rank 1")
    slow_host = [c for c in hot if c.kind == "slow_host"]
    assert all(c.confidence < hot[0].confidence and "see hot_experts" in c.evidence[-1] for c in slow_host)
    even = explain(_expert_parallel(tmp_path, "even", 1.0))  # the same slowness, the same load
    assert even[0].kind == "slow_host" and even[0].ranks == [1], [(c.kind, c.confidence) for c in even]
    assert not any(c.kind == "hot_experts" for c in even)


def test_a_death_only_the_watchdog_saw_is_explained_not_a_crash_of_explain(tmp_path):
    # no `fault` event (no next attempt reported it): an empty selection must stay a table
    from meshscope.collector.schema import Event
    from meshscope.collector.store import RunStore

    run = tmp_path / "dead"
    shutil.copytree(DATA / "clean-a", run)
    store = RunStore(run)
    store.add_event(
        Event(kind="hang", run_id="r", rank=0, step=70, detail={"type": "dead", "culprit_ranks": [1]})
    )
    store.close()
    causes = explain(run)
    found = [(c.kind, c.ranks) for c in causes]
    assert found and found[0] == ("crash", [1]), found


@pytest.mark.parametrize("report", ["heartbeat", "watchdog"])
@pytest.mark.parametrize("outlived_by", ["a later step", "the clean end"])
def test_a_death_the_rank_outlived_is_no_crash_but_a_real_one_after_a_restart_stays(
    tmp_path, report, outlived_by
):
    """A rank reported dead (its beat late on a busy host) that went on stepping, or was at the
    job's last barrier, did not die: naming it would be a wrong culprit. The same report followed
    by a restart (the rank came back in a new attempt) is a death."""
    from meshscope.collector.schema import Event
    from meshscope.collector.store import RunStore, load_events, load_steps

    def run_with(name: str, restart: bool) -> Path:
        run = tmp_path / name
        shutil.copytree(DATA / "clean-a", run)
        steps, end = load_steps(run), load_events(run, kind="run_end")["time"].max()
        at = steps.loc[steps["step"] == 100, "time"].max() if outlived_by == "a later step" else end - 0.5
        if report == "heartbeat":
            detail = {"type": "dead_rank", "rank": 1, "heartbeat_age_s": 1.6, "how": "heartbeat stopped"}
            event = Event(kind="fault", run_id="r", rank=0, step=99, detail=detail, time=at)
        else:
            event = Event(
                kind="hang", run_id="r", rank=0, detail={"type": "dead", "culprit_ranks": [1]}, time=at
            )
        store = RunStore(run)
        store.add_event(event)
        if restart:
            store.add_event(Event(kind="restart", run_id="r", rank=0, detail={"attempt": 1}, time=at + 0.001))
        store.close()
        return run

    outlived = [(c.kind, c.ranks) for c in explain(run_with("late", restart=False))]
    assert not any(kind in ("crash", "recovery_failing") for kind, _ in outlived), outlived
    died = [(c.kind, c.ranks) for c in explain(run_with("died", restart=True))]
    assert died and died[0][0] in ("crash", "recovery_failing") and died[0][1] == [1], died


def _with_checkpoints(tmp_path: Path, name: str, steps: list[int], held_s: float = 0.02) -> Path:
    """A recorded run with meshscope's checkpoint events added (in the background, as the
    trainer saves by default)."""
    from meshscope.collector.schema import Event
    from meshscope.collector.store import RunStore

    run = tmp_path / name
    shutil.copytree(DATA / name, run)
    store = RunStore(run)
    for step in steps:
        detail = {"saved_step": step, "held_s": held_s, "async": True}
        store.add_event(Event(kind="checkpoint", run_id="r", rank=0, step=step, detail=detail))
    store.close()
    return run


def test_a_straggler_with_checkpoints_inside_its_window_is_still_named(tmp_path):
    # slow: rank 1 computes 3x from step 80 for 10 steps; saves every 5 steps, two inside
    run = _with_checkpoints(tmp_path, "slow", list(range(5, 150, 5)))
    causes = explain(run)
    assert causes[0].kind == "slow_host" and causes[0].ranks == [1], [(c.kind, c.title) for c in causes]
    assert all(c.kind != "checkpoint" or c.confidence < 0.5 for c in causes)
    # saving runs in the background already: no advice to turn it on
    assert not any("async_checkpoint=true" in c.action for c in causes)


def test_a_clean_run_with_checkpoints_and_their_slow_steps_raises_nothing(tmp_path):
    run = _with_checkpoints(tmp_path, "clean-a", [40, 80, 120])
    with sqlite3.connect(run / "store.sqlite") as db:  # each save slows the next step: 1.5 s
        db.execute("UPDATE steps SET step_s = step_s + 1.5 WHERE step IN (41, 81, 121)")
    assert explain(run) == []
    out = meshscope("detect", "--run", str(run))
    assert out.returncode == 0 and "0 anomaly episode(s)" in out.stdout, out.stdout
    # the same slow steps without the saves are a fault (the check can fail)
    bare = tmp_path / "bare"
    shutil.copytree(DATA / "clean-a", bare)
    with sqlite3.connect(bare / "store.sqlite") as db:  # a stall is a second longer at least
        db.execute("UPDATE steps SET step_s = step_s + 1.5 WHERE step IN (41, 81, 121)")
    out = meshscope("detect", "--run", str(bare))
    assert out.returncode == 0 and "0 anomaly episode(s)" not in out.stdout, out.stdout


@pytest.mark.parametrize("name", ["three-1.3-b", "two-1.3-b", "one-1.3"])
def test_ranks_slower_than_their_own_pace_are_the_cause_even_when_they_are_the_median(name):
    """Recorded on 4 ranks sharing 2 cores (fixtures.recorded.PHASE_STRAGGLERS): the slow ranks
    are the first cause, no other rank, with the ones that kept their pace said to have waited;
    sharing the host is no excuse for a rank that changed pace while its peers did not."""
    from fixtures.recorded import PHASE_STRAGGLERS, PHASES

    slow = list(PHASE_STRAGGLERS[name][0])
    causes = explain(PHASES / name)
    assert causes and (causes[0].kind, causes[0].ranks) == ("slow_host", slow), [
        (c.kind, c.ranks, c.confidence) for c in causes
    ]
    assert "kept" in causes[0].title and "waited" in causes[0].evidence[-1]
    assert not any(c.kind == "host_oversubscribed" for c in causes)
    assert explain(PHASES / "clean-d") == []
