"""The root-cause view on recorded run stores: every page renders, deep links land on the
anomaly they name, the drill-down shows the culprit and the ranked causes, and the feedback
page turns an upload into suggestions and an approval into a queued change."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from fixtures.recorded import STORES
from fixtures.runs import REPO, meshscope
from meshscope.collector.controls import load_controls
from meshscope.collector.store import load_events
from meshscope.explain.facts import Anomaly, RunFacts
from meshscope.view import data

APP = str(REPO / "view" / "app.py")
DATA = STORES


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Recorded runs as a live run leaves them: anomalies judged and stored."""
    root = tmp_path_factory.mktemp("runs")
    for name in ("slow", "skip_collective", "expert_collapse-2", "nan"):
        shutil.copytree(DATA / name, root / name)
    for name in ("slow", "expert_collapse-2", "nan"):
        meshscope("detect", "--run", str(root / name), check=True)
    return root


def app(runs: Path, monkeypatch, page: str | None = None, **params: str) -> AppTest:
    monkeypatch.setenv("MESHSCOPE_VIEW_RUNS_DIR", str(runs))
    at = AppTest.from_file(APP, default_timeout=60)
    for k, v in params.items():
        at.query_params[k] = v
    at.run()
    if page is not None:
        at.switch_page(f"screens/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def text(at: AppTest) -> str:
    parts = [
        *(m.value for m in at.markdown),
        *(t.value for t in at.title),
        *(h.value for h in at.header),
        *(c.value for c in at.caption),
    ]
    return "\n".join(parts)


def plotted(values):
    """A chart's array as a list: plotly writes arrays as base64 ("bdata") or as lists."""
    if isinstance(values, dict):
        import base64

        import numpy as np

        return np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"]).tolist()
    return values


def anomaly_id(run: Path, type_: str) -> int:
    ev = load_events(run, kind="anomaly")
    return int(ev[[d["type"] == type_ for d in ev["detail"]]].iloc[0]["id"])


def test_runs_page_lists_every_run_with_its_health(runs, monkeypatch):
    at = app(runs, monkeypatch)
    assert at.title[0].value == "Runs"
    table = at.dataframe[0].value
    assert set(table["run"]) == {"slow", "skip_collective", "expert_collapse-2", "nan"}
    row = table.set_index("run").loc["skip_collective"]
    assert row["hangs"] == 1 and row["restarts"] == 1


@pytest.mark.parametrize("page", ["run", "anomalies", "experts", "debug", "feedback", "advisor"])
def test_every_page_renders_on_a_recorded_store(runs, monkeypatch, page):
    at = app(runs, monkeypatch, page, run="expert_collapse-2")
    assert "expert_collapse-2" in at.title[0].value


def test_a_deep_link_opens_the_anomaly_with_its_evidence_and_causes(runs, monkeypatch):
    aid = anomaly_id(runs / "slow", "straggler")
    at = app(runs, monkeypatch, run="slow", anomaly=str(aid))
    body = text(at)
    assert "straggler · ranks [1]" in body
    assert "1. slow_host" in body and "rank 1 computes" in body and "Next:" in body
    compared = next(d.value for d in at.dataframe if "flagged" in d.value.columns)
    assert compared.set_index("rank").loc[1, "flagged"]
    assert at.query_params["anomaly"] == [str(aid)] or at.query_params["anomaly"] == str(aid)


def test_a_link_to_an_anomaly_the_run_does_not_have_says_so(runs, monkeypatch):
    at = app(runs, monkeypatch, run="slow", anomaly="999999")
    assert any("#999999 is not in this run" in w.value for w in at.warning), [w.value for w in at.warning]


def test_an_alert_link_lands_on_the_hang_and_names_the_culprit(runs, monkeypatch):
    at = app(runs, monkeypatch, run="skip_collective", alert="HangDetected")
    body = text(at)
    assert "hang · ranks [1]" in body and "1. hang" in body and "all_reduce #24" in body


def test_an_embedded_alert_link_by_type_and_step_resolves(runs, monkeypatch):
    at = app(runs, monkeypatch, run="expert_collapse-2", type="expert_imbalance", start="64")
    assert "expert_imbalance" in text(at) and "routing" in text(at)


def test_an_unknown_run_in_a_link_says_so(runs, monkeypatch):
    at = app(runs, monkeypatch, run="no-such-run")
    assert any("no-such-run" in e.value for e in at.error)


def test_debug_page_shows_the_hang_diagnosis_and_stacks(runs, monkeypatch):
    at = app(runs, monkeypatch, "debug", run="skip_collective")
    assert "culprit **ranks [1]**" in text(at)


def test_resolve_link_prefers_ids_then_type_and_step_then_alert_kind():
    found = [
        Anomaly(7, "straggler", [1], 80, 89),
        Anomaly(8, "expert_imbalance", [], 60, 90, layer=1),
        Anomaly(None, "comm", [0, 1], 100, 105),
        Anomaly(9, "hang", [2], 120, 120),
    ]
    assert data.resolve_link({"anomaly": "8"}, found).id == 8
    assert data.resolve_link({"anomaly": "99"}, found) is None
    assert data.resolve_link({"type": "comm", "start": "100"}, found).type == "comm"
    assert data.resolve_link({"alert": "StragglerRank", "rank": "1"}, found).id == 7
    assert data.resolve_link({"alert": "ExpertImbalance", "layer": "1"}, found).id == 8
    assert data.resolve_link({"alert": "HangDetected"}, found).id == 9
    assert data.resolve_link({"alert": "AnomalyDetected", "step": "101"}, found).type == "comm"
    assert data.resolve_link({}, found) is None


SERVING_CSV = (
    b"layer,expert,tokens,latency_ms\n0,0,900,9\n0,1,50,2\n0,2,25,2\n0,3,25,2\n"
    b"1,0,250,2\n1,1,250,2\n1,2,250,2\n1,3,250,2\n"
)


def test_feedback_upload_suggests_and_approval_queues_a_bounded_change(tmp_path, monkeypatch):
    shutil.copytree(DATA / "expert_collapse-2", tmp_path / "run")
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    monkeypatch.setenv("MESHSCOPE_VIEW_CHANGES_TOKEN_FILE", str(token))
    at = app(tmp_path, monkeypatch, "feedback", run="run")
    at.file_uploader[0].upload("serving.csv", SERVING_CSV, "text/csv").run()
    at.button(key="ingest").click().run()
    assert not at.error, [e.value for e in at.error]
    diagnosis = next(d.value for d in at.dataframe if "hot experts" in d.value.columns)
    diagnosis = diagnosis.set_index("layer")
    assert diagnosis.loc[0, "serving"] < 0.3 and diagnosis.loc[0, "hot experts"] == "[0]"
    assert "router_bias" in text(at) and "placement" in text(at)
    events = load_events(tmp_path / "run", kind="suggestion")
    bias = int(events[[d["action"] == "router_bias" for d in events["detail"]]].iloc[0]["id"])
    at.text_input(key="approver").input("ana").run()
    at.text_input(key="token").input("guess").run()
    at.button(key=f"approve-{bias}").click().run()
    assert any("token is wrong" in e.value for e in at.error) and load_controls(tmp_path / "run").empty
    at.text_input(key="token").input("s3cret").run()
    at.button(key=f"approve-{bias}").click().run()
    assert at.success and "queued" in at.success[0].value
    approval = load_events(tmp_path / "run", kind="approval").iloc[0]["detail"]
    assert approval["by"] == "ana" and approval["suggestion"] == bias
    change = load_controls(tmp_path / "run").iloc[0]
    assert change["status"] == "pending" and change["kind"] == "router_bias"
    assert 1e-3 <= change["payload"][0] <= 0.05 and max(map(abs, change["payload"][1:])) <= 5


def test_without_allow_changes_the_view_cannot_queue_a_change(tmp_path, monkeypatch):
    shutil.copytree(DATA / "expert_collapse-2", tmp_path / "run")
    monkeypatch.delenv("MESHSCOPE_VIEW_CHANGES_TOKEN_FILE", raising=False)
    at = app(tmp_path, monkeypatch, "feedback", run="run")
    at.file_uploader[0].upload("serving.csv", SERVING_CSV, "text/csv").run()
    at.button(key="ingest").click().run()
    assert not load_events(tmp_path / "run", kind="suggestion").empty  # there was a change to approve
    assert not [b for b in at.button if str(b.key).startswith("approve-")]
    assert "Read-only view" in text(at)


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("bad.csv", b"layer,expert\n0,1\n", "missing tokens"),
        ("bad.csv", b"layer,expert,tokens\n0,1,lots\n", "row 2: tokens"),
        ("evil.pt", b"\x80\x04\x95garbage", "never code"),
        ("empty.csv", b"", "empty"),
    ],
)
def test_malformed_uploads_get_a_clear_message(tmp_path, monkeypatch, name, content, message):
    shutil.copytree(DATA / "slow", tmp_path / "run")
    at = app(tmp_path, monkeypatch, "feedback", run="run")
    at.file_uploader[0].upload(name, content).run()
    at.button(key="ingest").click().run()
    assert any(message in e.value for e in at.error), [e.value for e in at.error]
    assert load_events(tmp_path / "run", kind="suggestion").empty


def test_facts_of_a_run_without_stored_anomalies_come_from_a_replay():
    facts = RunFacts.load(DATA / "slow")
    assert [a.type for a in facts.anomalies] == ["straggler"] and facts.anomalies[0].id is None


def test_debug_page_shows_the_tracers_tensor_statistics(runs, monkeypatch, tmp_path):
    from meshscope.collector.store import RunStore

    run = tmp_path / "runs" / "traced"
    shutil.copytree(DATA / "nan", run)
    store = RunStore(run)
    rows = [
        {"step": s, "rank": r, "module": "blocks.0.ln1", "where": "forward", "absmax": 1.0 + s,
         "norm": 2.0, "mean": 0.0, "std": 1.0, "nonfinite": int(s == 20 and r == 1)}
        for s in (10, 20) for r in (0, 1)
    ]  # fmt: skip
    store.add_tensor_stats(rows)
    store.close()
    at = app(run.parent, monkeypatch, "debug", run="traced")
    assert "Tensor statistics per module" in text(at)
    flagged = at.dataframe[-1].value
    assert list(zip(flagged["step"], flagged["rank"])) == [(20, 1)]


def test_the_run_page_shows_whose_compute_is_slow(runs, monkeypatch):
    import json

    at = app(runs, monkeypatch, "run", run="slow")
    charts = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    compute = next(c for c in charts if "compute per rank" in c["layout"]["title"]["text"])

    by_rank = {t["name"]: dict(zip(plotted(t["x"]), plotted(t["y"]))) for t in compute["data"]}
    one, zero = by_rank["1"], by_rank["0"]
    slower = lambda a, b: sum(a[s] > 1.5 * b[s] for s in a if s in b)  # noqa: E731
    assert slower(one, zero) >= 8 and slower(zero, one) <= 2, (slower(one, zero), slower(zero, one))
    assert any("exposed communication per rank" in c["layout"]["title"]["text"] for c in charts)


def test_the_timeline_reads_faults_as_people_do():
    from meshscope.view.data import timeline

    killed = timeline(load_events(STORES / "kill"))
    fault = killed[killed["kind"] == "fault"].iloc[0]
    assert fault["rank"] == 1 and "rank 1" in fault["summary"]  # the rank that died, not its reporter
    import re

    assert not re.search(r"\b1\d{9}(\.\d+)?\b", " ".join(killed["summary"])), killed["summary"]  # no epochs
    aborted = timeline(load_events(STORES / "skip_collective"))
    stopped = aborted[aborted["kind"] == "fault"]
    assert (stopped["severity"] == "info").all() and stopped["summary"].str.contains("on purpose").all()


def test_evidence_reads_as_rows_not_json(runs, monkeypatch):
    from meshscope.view.data import evidence_rows

    rows = evidence_rows({"compute_s": {"0": 0.0163, "1": 0.0527}, "ratio": 3.2345, "ranks": [1, 2]})
    assert rows.values.tolist() == [
        ["compute s, rank 0", "0.0163"],
        ["compute s, rank 1", "0.0527"],
        ["ratio", "3.235"],
        ["ranks", "1, 2"],
    ]
    aid = anomaly_id(runs / "slow", "straggler")
    at = app(runs, monkeypatch, run="slow", anomaly=str(aid))
    assert not at.json, "evidence is a table now"
    shown = next(d.value for d in at.dataframe if "what" in d.value.columns)
    assert "compute s, rank 1" in shown["what"].tolist()


def test_the_selected_run_survives_a_change_of_page_in_the_sidebar(runs, monkeypatch):
    # a deep link to one run, then the sidebar's page links (which drop the URL's parameters):
    # every page stays on the linked run, not the newest one
    at = app(runs, monkeypatch, run="nan")
    for page in ("experts", "debug", "run"):
        at.query_params.clear()  # what a sidebar link leaves in the URL
        at.switch_page(f"screens/{page}.py").run()
        assert not at.exception, [e.value for e in at.exception]
        assert at.sidebar.selectbox[0].value == "nan", (page, at.sidebar.selectbox[0].value)


def test_a_job_that_ended_before_its_first_step_says_so_with_its_real_time(tmp_path):
    """Not "finished, 0 ranks, updated 1970": the row says it never trained, and when."""
    from meshscope.collector.schema import Event
    from meshscope.collector.store import insert_events

    run = tmp_path / "never"
    run.mkdir()
    insert_events(run, [Event(kind="run_end", run_id="never", time=1_790_000_000.0)])
    row = data.run_summary(run)
    assert row["status"] == "ended before its first step" and row["steps"] == 0
    assert row["updated"].timestamp() == 1_790_000_000.0


def test_the_run_page_shows_where_the_time_went_as_the_account_has_it(runs, monkeypatch):
    import json

    from meshscope.collector.report import efficiency

    at = app(runs, monkeypatch, "run", run="skip_collective")  # a hang the watchdog aborted, a restart
    body = text(at)
    assert "Where the time went" in body and "ETTR" in body and "Maturity" in body, body
    charts = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    bars = next(c for c in charts if "wall time by bucket" in c["layout"]["title"]["text"])
    account = efficiency(runs / "skip_collective")["account"]
    drawn = {
        t["name"]: dict(zip(plotted(t["y"]), plotted(t["x"]))) for t in bars["data"]
    }  # bucket -> who -> seconds
    assert sum(who["job"] for who in drawn.values()) == pytest.approx(account.wall_s)
    assert drawn["hang"]["job"] == pytest.approx(account.job["hang"]) and account.job["hang"] > 0
    colours = {t["name"]: t["marker"]["color"] for t in bars["data"]}
    assert colours["hang"] == "#8c564b" and colours["compute"] == "#2ca02c"  # fixed, whatever the run


def test_a_job_that_lost_a_node_before_its_steps_were_stored_still_counts_its_ranks(tmp_path):
    """Rank 0 announced a world of 4; only ranks 0 and 1 wrote steps (the other node lost power
    before its first batch reached the job store): the job had 4 ranks, not 2."""
    from meshscope.collector.schema import Event, StepRecord
    from meshscope.collector.store import RunStore

    run = tmp_path / "job"
    store = RunStore(run)
    store.add_event(Event(kind="run_start", run_id="job", rank=0, detail={"world_size": 4}))
    for rank in (0, 1):
        store.add_step(StepRecord(run_id="job", rank=rank, world_size=4, step=0, time=1e9, step_s=0.1))
    store.close()
    assert data.run_summary(run)["ranks"] == 4
