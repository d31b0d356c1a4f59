"""The generated Prometheus and Alertmanager configs pass their own tools; the rules pass their
unit tests (promtool test rules); the boards are current and query only what we export."""

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from meshscope.alerts.config import AlertRouting
from meshscope.collector.metrics import DetectorMetrics, MeshscopeMetrics
from meshscope.collector.schema import StepRecord
from meshscope.dashboards.alertmanager import alertmanager_config, checked, write_alertmanager_config
from meshscope.dashboards.boards import OUT, board_queries, build_all, render
from meshscope.dashboards.prometheus import RULES, write_prometheus_config
from tests.conftest import require_binary

ALERTS = {
    "TrainingStalled",
    "RankDown",
    "StragglerRank",
    "CommRatioHigh",
    "ExpertImbalance",
    "LossNotFinite",
    "AnomalyDetected",
    "RecoveryFailed",
    "HangDetected",
}


def _run(*cmd):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_promtool_checks_the_config_and_the_rules(tmp_path):
    promtool = require_binary("promtool")
    config = write_prometheus_config(
        tmp_path / "prometheus.yml", tmp_path / "runs", rule_files=[str(RULES)], alertmanager="127.0.0.1:9093"
    )
    _run(promtool, "check", "config", str(config))
    assert "SUCCESS: 21 rules found" in _run(promtool, "check", "rules", str(RULES))


def test_every_alert_has_a_passing_promtool_unit_test():
    promtool = require_binary("promtool")
    tests = RULES.with_name("rules_test.yml")
    _run(promtool, "test", "rules", str(tests))
    defined = {
        r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r
    }
    tested = {
        t["alertname"]
        for case in yaml.safe_load(tests.read_text())["tests"]
        for t in case["alert_rule_test"]
        if t["exp_alerts"]
    }
    assert defined == ALERTS and tested == ALERTS


def test_a_wrong_expectation_fails_promtool(tmp_path):
    """The unit tests can fail: a changed expected value is caught."""
    promtool = require_binary("promtool")
    broken = tmp_path / "rules_test.yml"
    broken.write_text(RULES.with_name("rules_test.yml").read_text().replace('value: "3.00"', 'value: "2.90"'))
    (tmp_path / "rules.yml").write_text(RULES.read_text())
    assert subprocess.run([promtool, "test", "rules", str(broken)], capture_output=True).returncode != 0


@pytest.mark.parametrize("first_scraped", ["0 0 1 1", "1 1 1 1"], ids=["seen-rising", "first-seen-at-1"])
def test_the_anomaly_annotation_marks_an_anomaly_whenever_its_counter_was_first_scraped(
    tmp_path, first_scraped
):
    # the detector's endpoint may be found after its first anomaly: the series then starts at 1,
    # and changes() alone never sees it rise (an e2e run lost its annotation that way)
    promtool = require_binary("promtool")
    expr = dict(board_queries(build_all()["training"]))["annotation Anomalies"].replace("$run", "r1")
    (tmp_path / "empty.yml").write_text("groups: []\n")
    case = {
        "rule_files": ["empty.yml"],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": [
                    {
                        "series": 'meshscope_anomalies_total{run="r1",type="straggler"}',
                        "values": first_scraped,
                    }
                ],
                "promql_expr_test": [
                    {
                        "expr": expr,
                        "eval_time": "30s",
                        "exp_samples": [{"labels": '{type="straggler"}', "value": 1}],
                    }
                ],
            }
        ],
    }
    (tmp_path / "annotation_test.yml").write_text(yaml.safe_dump(case))
    _run(promtool, "test", "rules", str(tmp_path / "annotation_test.yml"))


@pytest.mark.parametrize("email", [False, True])
def test_amtool_accepts_the_alertmanager_config(tmp_path, email):
    amtool = require_binary("amtool")
    hook, password = tmp_path / "hook", tmp_path / "password"
    hook.write_text("https://hooks.slack.invalid/T/B/X\n")
    password.write_text("s3cret-pw\n")
    routing = AlertRouting(
        slack_webhook_file=hook,
        email_to=["oncall@example.org"] if email else [],
        smtp="127.0.0.1:1025",
        smtp_user="bot",
        smtp_password_file=password if email else None,
    )
    path = write_alertmanager_config(tmp_path / "am", routing)
    out = _run(amtool, "check-config", str(path))
    assert "SUCCESS" in out and "2 inhibit rules" in out
    text = path.read_text()
    assert "hooks.slack.invalid" not in text and "s3cret-pw" not in text  # files, not secrets


def test_routing_warning_to_slack_critical_to_slack_and_email_inhibition_by_rank():
    config = alertmanager_config(AlertRouting(email_to=["a@example.org"]), templates=[])
    assert config["route"]["receiver"] == "slack" and config["route"]["group_by"] == ["alertname", "run"]
    critical = config["route"]["routes"][0]
    assert critical["matchers"] == ['severity="critical"'] and critical["receiver"] == "slack-and-email"
    receivers = {r["name"]: r for r in config["receivers"]}
    assert "email_configs" in receivers["slack-and-email"] and "email_configs" not in receivers["slack"]
    rank_down = config["inhibit_rules"][0]
    assert rank_down["target_matchers"] == ['alertname="StragglerRank"'] and rank_down["equal"] == [
        "run",
        "rank",
    ]


def test_bad_routing_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="slack_webhook_file"):
        checked(AlertRouting(slack_webhook_file=tmp_path / "missing"))
    with pytest.raises(ValueError, match="smtp"):
        checked(AlertRouting(email_to=["a@example.org"], smtp="localhost"))


def test_committed_boards_are_what_the_code_generates():
    for name, board in build_all().items():
        assert (OUT / f"{name}.json").read_text() == render(board), (
            f"{name}.json is stale: run `meshscope dashboards build`"
        )


def test_boards_have_the_panels_and_variables_people_need():
    boards = build_all()
    assert set(boards) == {"training", "experts", "faults", "debug"}
    for board in boards.values():
        names = [v["name"] for v in board["templating"]["list"]]
        assert "run" in names and board["uid"].startswith("meshscope-")
    assert "layer" in [v["name"] for v in boards["experts"]["templating"]["list"]]
    assert any(p["type"] == "heatmap" for p in boards["experts"]["panels"])
    titles = " ".join(p.get("title", "") for b in boards.values() for p in b["panels"]).lower()
    for needed in (
        "p50 / p99",
        "tokens/s",
        "comm",
        "compression",
        "memory",
        "imbalance",
        "top experts",
        "restarts",
        "recovery",
        "anomaly score",
        "non-finite",
        "hung",
    ):
        assert needed in titles, needed


def test_boards_query_only_series_that_exist(tmp_path):
    """Every metric a panel names is exported by a rank or the detector, or recorded by a rule."""
    from meshscope.collector.store import RunStore
    from meshscope.collector.timeaccount import TimeAccountCollector

    ranks, detector = CollectorRegistry(), CollectorRegistry()  # two endpoints, as deployed
    DetectorMetrics(detector)
    # a rank's families once a step that logged its loss and grad norm is out
    step = StepRecord(run_id="r", rank=0, world_size=1, step=0, time=0.0, step_s=0.1, loss=1.0, grad_norm=1.0)
    MeshscopeMetrics(ranks).observe_step(step)
    store = RunStore(tmp_path)  # the detector's time account, as the sidecar registers it
    store.add_step(step)
    store.close()
    detector.register(TimeAccountCollector(tmp_path))
    exported = set()
    for fam in [*ranks.collect(), *detector.collect()]:
        exported |= {s.name for s in fam.samples} | {fam.name, f"{fam.name}_total", f"{fam.name}_bucket"}
    recorded = {
        r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "record" in r
    }
    known = exported | recorded | {"up"}
    for board in build_all().values():
        for where, expr in board_queries(board):
            for name in re.findall(
                r"\b((?:meshscope|run|run_rank|run_layer|run_layer_expert)[:\w]*|up)\b(?=\{|\)|\s|$)", expr
            ):
                if (
                    name.startswith(("meshscope_", "run:", "run_rank:", "run_layer:", "run_layer_expert:"))
                    or name == "up"
                ):
                    assert name in known, f"{where}: {name} is neither exported nor recorded"


def test_provisioning_points_at_the_generated_boards():
    prov = Path(OUT).parent / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "meshscope.yml").read_text())["datasources"][0]
    assert ds["type"] == "prometheus" and ds["isDefault"] is True
    boards = yaml.safe_load((prov / "dashboards" / "meshscope.yml").read_text())["providers"][0]
    assert boards["type"] == "file" and boards["options"]["path"].endswith("meshscope")
    assert all(json.loads(p.read_text())["uid"] for p in OUT.glob("*.json"))


def test_compose_configs_are_current_and_valid(tmp_path):
    from meshscope.dashboards.compose import FOLDER, compose_configs

    for name, text in compose_configs().items():
        assert (FOLDER / name).read_text() == text, f"{name} is stale: run `meshscope dashboards build`"
    amtool = require_binary("amtool")
    assert "SUCCESS" in _run(amtool, "check-config", str(FOLDER / "alertmanager.yml"))
    prom = yaml.safe_load((FOLDER / "prometheus.yml").read_text())
    assert prom["rule_files"] == ["/etc/prometheus/rules.yml"]
    assert prom["scrape_configs"][0]["file_sd_configs"][0]["files"] == ["/app/runs/_targets/*.json"]


def test_compose_grafana_has_no_default_admin_password():
    compose = yaml.safe_load((Path(__file__).resolve().parents[2] / "docker-compose.yml").read_text())
    grafana = compose["services"]["grafana"]["environment"]
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"] == "${GRAFANA_ADMIN_PASSWORD:?set GRAFANA_ADMIN_PASSWORD}"
    assert {"trainer", "prometheus", "alertmanager", "grafana"} <= set(compose["services"])
