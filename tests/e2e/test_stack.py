"""The whole monitoring path on real binaries: `meshscope stack up` (Prometheus with our rules,
Alertmanager with our routing, VictoriaMetrics fed by remote_write, a PostgreSQL job store), a
real run with injected faults, a Slack-style webhook sink and an aiosmtpd mailbox. Every board's
PromQL and every alert rule runs against what Prometheus scraped and what VictoriaMetrics got."""

import json
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
import requests
import yaml

from fixtures.ports import free_port_range
from fixtures.runs import REPO, meshscope, start_run, wait_for
from fixtures.sinks import Mailbox, Sink
from meshscope.collector.storedb import locate, pg_connect
from meshscope.dashboards.boards import board_queries, build_all
from meshscope.dashboards.prometheus import RULES
from tests.conftest import require_binary

pytestmark = pytest.mark.e2e
RUN = "e2e"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    for binary in ("prometheus", "prometheus-alertmanager", "victoria-metrics"):
        require_binary(binary)
    tmp = tmp_path_factory.mktemp("stack")
    sink, mailbox = Sink().start(), Mailbox().start()
    hook = tmp / "slack-webhook"
    hook.write_text(sink.url + "\n")
    prom_port = free_port_range(4)
    # not under pytest's folders, which are private to root: the job store runs as `postgres`
    home = Path(tempfile.mkdtemp(prefix="meshscope-stack-"))
    home.chmod(0o711)
    up = meshscope(
        "stack",
        "up",
        "--runs",
        str(tmp / "runs"),
        "--home",
        str(home),
        "--prometheus-port",
        str(prom_port),
        "--alertmanager-port",
        str(prom_port + 1),
        "--scrape-interval",
        "1",
        "--slack-webhook-file",
        str(hook),
        "--email-to",
        "oncall@localhost",
        "--smtp",
        f"127.0.0.1:{mailbox.port}",
        "--no-smtp-tls",
        "--fast",
        "--view-url",
        "http://view.local:8501",
        "--remote-write",
        "--victoria-port",
        str(prom_port + 2),
        "--store",
        "--store-port",
        str(prom_port + 3),
    )
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield {
            "tmp": tmp,
            "home": home,
            "sink": sink,
            "mailbox": mailbox,
            "runs": tmp / "runs",
            "prom": f"http://127.0.0.1:{prom_port}",
            "am": f"http://127.0.0.1:{prom_port + 1}",
            "vm": f"http://127.0.0.1:{prom_port + 2}",
            "store": up.stdout,
        }
    finally:
        meshscope("stack", "down", "--home", str(home))
        shutil.rmtree(home, ignore_errors=True)
        sink.stop()
        mailbox.stop()


@pytest.fixture(scope="module")
def faulty_run(stack):
    """A 2-rank run: a NaN loss on rank 1, then rank 1 computes 4x slower until the alerts have
    arrived and the run is stopped (SIGTERM, as a scheduler cancels a job). The slowdown lasts
    as long as it takes, on an idle machine (steps of a few ms) or a busy one alike."""
    port = free_port_range(3)
    proc = start_run(
        stack["runs"],
        RUN,
        port,
        "--steps",
        "1000000",
        "--inject",
        "nan@step=30,rank=1",
        "--inject",
        "slow@step=60,rank=1,steps=1000000,factor=4",
    )
    started = time.time()
    sink, mailbox = stack["sink"], stack["mailbox"]

    def slack(alertname):
        return [t for t in sink.texts() if alertname in t and "FIRING" in t]

    try:
        email = wait_for(lambda: [b for b in mailbox.bodies() if "LossNotFinite" in b], 150)
        straggler = wait_for(lambda: slack("StragglerRank"), 150)
        anomaly = wait_for(lambda: [t for t in slack("AnomalyDetected") if "type=straggler" in t], 60)
        time.sleep(10)  # a few more scrapes of the slow rank for the boards' 1 m windows
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    yield {
        "proc": proc,
        "started": started,
        "straggler": straggler,
        "email": email,
        "anomaly": anomaly,
        "slack_nan": slack("LossNotFinite"),
    }


@pytest.fixture(scope="module")
def shipped(faulty_run, stack):
    """The time up to which VictoriaMetrics holds what Prometheus holds of the run: remote_write
    ships in batches, later still on a busy machine, so the comparisons wait for it."""
    until = time.time() - 2
    deadline = time.monotonic() + 90
    while True:
        seen = [_shipped_state(stack[engine], faulty_run["started"], until) for engine in ("prom", "vm")]
        if _caught_up(*seen) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert _caught_up(*seen), f"VictoriaMetrics never caught up with Prometheus: {seen}"
    return until


def _shipped_state(url: str, start: float, until: float) -> tuple[set, float]:
    """The run's series, and the newest point of its recorded straggler ratio, up to `until`."""
    series = requests.get(
        f"{url}/api/v1/series",
        params={"match[]": f'{{run="{RUN}"}}', "start": start, "end": until},
        timeout=10,
    ).json()["data"]
    ratio = _query_range(url, "run_rank:meshscope_compute_vs_median:ratio", start, until)["data"]["result"]
    newest = max((float(t) for s in ratio for t, _ in s["values"]), default=0.0)
    return {json.dumps(s, sort_keys=True) for s in series}, newest


def _caught_up(prom: tuple[set, float], vm: tuple[set, float]) -> bool:
    return prom[0] <= vm[0] and prom[1] > 0 and vm[1] >= prom[1] - 1.5


def test_status_says_what_runs_where(stack):
    out = meshscope("stack", "status", "--home", str(stack["home"]))
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"prometheus\s.*" + re.escape(stack["prom"]) + r".*ready", out.stdout)
    assert re.search(r"alertmanager\s.*" + re.escape(stack["am"]) + r".*ready", out.stdout)
    assert re.search(r"victoria-metrics\s.*" + re.escape(stack["vm"]) + r".*ready", out.stdout)
    assert re.search(r"postgres\s.*ready", out.stdout), out.stdout


def test_a_slow_rank_reaches_slack_naming_run_rank_value_and_link(faulty_run):
    assert faulty_run["straggler"], "no StragglerRank message reached the webhook sink"
    text = faulty_run["straggler"][0]
    assert f"run {RUN}" in text and "rank=1" in text and "value:" in text
    assert f"http://view.local:8501/?run={RUN}&rank=1" in text


def test_a_nan_is_critical_so_it_reaches_email_and_slack(faulty_run, stack):
    assert faulty_run["email"], "no LossNotFinite email reached the mailbox"
    body = faulty_run["email"][0]
    assert "rank=1" in body and f"run={RUN}" in body and "drill down:" in body
    assert stack["mailbox"].recipients[0] == ["oncall@localhost"]
    assert faulty_run["slack_nan"]


def test_the_detectors_anomaly_also_alerts(faulty_run):
    assert faulty_run["anomaly"], "the straggler the detectors found never reached Slack"
    # its link names the anomaly's type, so the view lands on it
    assert (
        f"http://view.local:8501/?run={RUN}&type=straggler&alert=AnomalyDetected" in faulty_run["anomaly"][0]
    )


@pytest.mark.parametrize("engine", ["prom", "vm"], ids=["prometheus", "victoria-metrics"])
def test_every_panel_query_returns_data_from_the_real_run(faulty_run, stack, shipped, engine):
    end = shipped
    failures = []
    for name, board in build_all().items():
        for where, expr in board_queries(board):
            promql = (
                expr.replace("$run", RUN)
                .replace('layer=~"$layer"', 'layer=~"0|1"')
                .replace("$__rate_interval", "20s")
            )
            if where.startswith("variable"):
                promql = re.sub(r"label_values\((.*), \w+\)", r"\1", promql)
            body = _query_range(stack[engine], promql, faulty_run["started"], end)
            if body.get("status") != "success" or not body["data"]["result"]:
                failures.append(f"{name}: {where}: {promql} -> {body.get('error') or 'no data'}")
    assert not failures, "\n".join(failures)


def _query_range(url: str, promql: str, start: float, end: float, step: float = 1) -> dict:
    r = requests.get(
        f"{url}/api/v1/query_range",
        timeout=10,
        params={"query": promql, "start": start, "end": end, "step": f"{step:g}s"},
    )
    return r.json()


def test_every_alert_rule_answers_alike_on_prometheus_and_victoria_metrics(faulty_run, stack, shipped):
    """Long retention must not change a verdict: each rule's expression, over the run, finds the
    same series on both engines (the straggler and the detector's anomaly among them)."""
    end = shipped
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]
    found = {}
    for rule in rules:
        deadline = time.monotonic() + 20  # and what was shipped lands within a few seconds
        while True:
            series = []
            for engine in ("prom", "vm"):
                body = _query_range(stack[engine], rule["expr"], faulty_run["started"], end)
                assert body.get("status") == "success", (engine, rule["alert"], body)
                series.append({json.dumps(s["metric"], sort_keys=True) for s in body["data"]["result"]})
            if series[0] == series[1] or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert series[0] == series[1], (rule["alert"], series)
        found[rule["alert"]] = bool(series[0])
    # not vacuous: the alerts that reached Slack, as Prometheus's own ALERTS series has them,
    # are found by their rule's expression on both engines
    fired = _query_range(stack["prom"], 'ALERTS{alertstate="firing"}', faulty_run["started"], end, step=1)
    fired_names = {s["metric"]["alertname"] for s in fired["data"]["result"]}
    assert {"StragglerRank", "AnomalyDetected"} <= fired_names, fired_names
    assert found["StragglerRank"] and found["AnomalyDetected"], (found, fired_names)


def test_the_stack_job_store_takes_a_run_and_every_reader_reads_it(stack, tmp_path):
    match = re.search(r"--store (\S+) --store-password-file (\S+)", stack["store"])
    assert match, stack["store"]
    run = meshscope(
        "run",
        "--config",
        str(REPO / "fixtures" / "tiny.toml"),
        "--run-dir",
        str(tmp_path),
        "--run-id",
        "pg",
        "--steps",
        "6",
        "--metrics-port",
        str(free_port_range(3)),
        "--store",
        match[1],
        "--store-password-file",
        match[2],
        timeout=180,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "schema ms_pg" in run.stdout and "6 x 2" in run.stdout, run.stdout[-1500:]
    with pg_connect(locate(tmp_path / "pg")) as conn:  # the node's relay shipped every row
        assert conn.execute("SELECT count(*) FROM steps").fetchone()[0] == 12
    explain = meshscope("explain", "--run", str(tmp_path / "pg"))
    assert explain.returncode == 0, explain.stdout + explain.stderr


def test_rank_down_silences_straggler_for_that_rank_only(stack):
    """Inhibition, on the real Alertmanager: alerts posted to its API as Prometheus would."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    alerts = [
        {
            "labels": {"alertname": name, "run": "inhib", "rank": rank, "severity": sev},
            "annotations": {"summary": f"{name} {rank}", "value": "1"},
            "startsAt": now,
        }
        for name, rank, sev in [
            ("RankDown", "1", "critical"),
            ("StragglerRank", "1", "warning"),
            ("StragglerRank", "0", "warning"),
        ]
    ]
    assert requests.post(f"{stack['am']}/api/v2/alerts", json=alerts, timeout=5).ok

    def inhib_messages():
        return [t for t in stack["sink"].texts() if "run inhib" in t]

    assert wait_for(lambda: len(inhib_messages()) >= 2, 30)
    time.sleep(3)  # room for a wrongly delivered third message
    texts = "\n".join(inhib_messages())
    assert "RankDown" in texts and "StragglerRank 0" in texts and "StragglerRank 1" not in texts


def test_one_alert_path_a_run_under_the_stack_never_pages_from_its_own_outbox(stack):
    hook = stack["tmp"] / "slack-webhook"
    out = meshscope(
        "run",
        "--config",
        str(REPO / "fixtures/tiny.toml"),
        "--run-dir",
        str(stack["runs"]),
        "--run-id",
        "one-path",
        "--steps",
        "3",
        "--metrics-port",
        str(free_port_range(3)),
        "--stack-home",
        str(stack["home"]),
        "--slack-webhook-file",
        str(hook),
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"through Alertmanager at {stack['am']}" in out.stdout
    assert "ignored" in out.stderr and "--alerts embedded" in out.stderr
    assert not (stack["runs"] / "one-path" / "outbox").exists()
    refused = meshscope(
        "run",
        "--config",
        str(REPO / "fixtures/tiny.toml"),
        "--run-dir",
        str(stack["tmp"] / "elsewhere"),
        "--alerts",
        "alertmanager",
        "--stack-home",
        str(stack["home"]),
    )
    assert refused.returncode == 2 and "no meshscope stack" in refused.stderr
    assert not (stack["tmp"] / "elsewhere").exists()
