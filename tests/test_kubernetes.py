"""The Kubernetes manifests (deploy/kubernetes/) hold together with the code and with each
other, offline: every flag and setting exists, the run's TOML loads, every port the code opens
is declared and scraped, the selectors meet, every ConfigMap, Secret and Service a pod names is
defined, the job store is the Service, the PrometheusRule is the rules `stack up` uses, and the
series a PodMonitor scrapes carry the labels the rules and boards group by."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from fixtures.ports import free_port_range
from meshscope.cli.flags import RUN_FLAGS, field_at
from meshscope.collector.exporter import RANK_JOB, port_for, serve_metrics
from meshscope.collector.storedb import check_url
from meshscope.config import RunConfig, load_config
from meshscope.dashboards.prometheus import prometheus_rule, render_rules

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict]:
    docs = [d for path in sorted(DEPLOY.glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs if d["kind"] != "Kustomization"}


def test_the_kustomization_applies_every_manifest():
    listed = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")


def test_every_config_map_secret_and_service_a_pod_names_is_defined(manifests):
    pod = _pod(manifests)["spec"]
    for volume in pod["volumes"]:
        if "configMap" in volume:
            data = manifests[f"ConfigMap/{volume['configMap']['name']}"]["data"]
            assert {i["key"] for i in volume["configMap"]["items"]} <= set(data)
        if "secret" in volume:
            data = manifests[f"Secret/{volume['secret']['secretName']}"]["stringData"]
            assert {i["key"] for i in volume["secret"]["items"]} <= set(data)
    server = manifests["StatefulSet/meshscope-store"]["spec"]
    assert manifests[f"Service/{server['serviceName']}"]["spec"]["clusterIP"] == "None"  # headless
    for env in server["template"]["spec"]["containers"][0]["env"]:
        if "valueFrom" in env:
            ref = env["valueFrom"]["secretKeyRef"]
            assert ref["key"] in manifests[f"Secret/{ref['name']}"]["stringData"]


def test_the_run_reads_the_toml_of_its_config_map(manifests, tmp_path):
    container = _pod(manifests)["spec"]["containers"][0]
    config = Path(_flags(container["command"])["config"][0])
    mount = next(m for m in container["volumeMounts"] if Path(m["mountPath"]) == config.parent)
    volume = next(v for v in _pod(manifests)["spec"]["volumes"] if v["name"] == mount["name"])
    item = next(i for i in volume["configMap"]["items"] if i["path"] == config.name)
    toml = tmp_path / config.name
    toml.write_text(manifests[f"ConfigMap/{volume['configMap']['name']}"]["data"][item["key"]])
    assert load_config(toml, {}).train.steps > 0  # ConfigError names the field otherwise


def test_the_prometheus_rule_is_the_rules_the_stack_loads(manifests):
    rule = manifests["PrometheusRule/meshscope"]
    regenerate = "python -m meshscope.dashboards.prometheus --write-rules"
    assert yaml.safe_load(prometheus_rule()) == rule, regenerate
    assert rule["spec"]["groups"] == yaml.safe_load(render_rules())["groups"]
    selector = manifests["Prometheus/meshscope"]["spec"]["ruleSelector"]["matchLabels"]
    assert selector.items() <= rule["metadata"]["labels"].items()


def _flags(command: list[str]) -> dict[str, list[str]]:
    assert command[:2] == ["meshscope", "run"], command
    flags: dict[str, list[str]] = {}
    for name, value in zip(command[2::2], command[3::2]):
        assert name.startswith("--"), (name, value)
        flags.setdefault(name[2:], []).append(value)
    return flags


def _pod(manifests):
    job = manifests["PyTorchJob/moe-train"]["spec"]["pytorchReplicaSpecs"]
    assert job["Master"]["template"] == job["Worker"]["template"]  # every node runs the same
    return job["Master"]["template"]


def test_the_job_runs_meshscope_with_flags_and_settings_it_has(manifests):
    flags = _flags(_pod(manifests)["spec"]["containers"][0]["command"])
    assert set(flags) <= set(RUN_FLAGS) | {"config", "set"}, set(flags) - set(RUN_FLAGS)
    for setting in flags["set"]:
        path, _ = setting.split("=", 1)
        field_at(RunConfig, path)  # KeyError for a setting that does not exist
    assert check_url(flags["store"][0])


def test_every_port_the_code_opens_is_declared_and_scraped(manifests):
    pod = _pod(manifests)
    container = pod["spec"]["containers"][0]
    flags = _flags(container["command"])
    nproc, base = int(flags["nproc"][0]), int(flags["metrics-port"][0])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    ranks = {f"rank{i}": port_for(base, i) for i in range(nproc)}
    assert {k: ports[k] for k in ranks} == ranks
    assert ports["detector"] == base + nproc  # the sidecar's exporter, after the ranks'
    assert ports["rendezvous"] == int(flags["rdzv-endpoint"][0].rsplit(":", 1)[1])
    monitor = manifests["PodMonitor/meshscope-train"]
    scraped = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert scraped == set(ranks) | {"detector"}
    labels = pod["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    prometheus = manifests["Prometheus/meshscope"]["spec"]
    assert prometheus["podMonitorSelector"]["matchLabels"].items() <= monitor["metadata"]["labels"].items()
    # the series carry their own topology only when the run is told to stamp it
    assert "monitor.metrics_labels=true" in flags["set"]
    assert all(e["honorLabels"] for e in monitor["spec"]["podMetricsEndpoints"])


def test_the_job_store_is_the_service_and_its_password_a_mounted_secret(manifests):
    container = _pod(manifests)["spec"]["containers"][0]
    flags = _flags(container["command"])
    store = re.match(r"postgresql://(\w+)@([\w-]+):(\d+)/", flags["store"][0])
    service = manifests[f"Service/{store[2]}"]
    assert int(store[3]) in [p["port"] for p in service["spec"]["ports"]]
    server = manifests[f"StatefulSet/{store[2]}"]["spec"]["template"]
    assert service["spec"]["selector"].items() <= server["metadata"]["labels"].items()
    env = {e["name"]: e for e in server["spec"]["containers"][0]["env"]}
    assert env["POSTGRES_USER"]["value"] == store[1]
    password = Path(flags["store-password-file"][0])
    mount = next(m for m in container["volumeMounts"] if Path(m["mountPath"]) == password.parent)
    volume = next(v for v in _pod(manifests)["spec"]["volumes"] if v["name"] == mount["name"])
    key = env["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert volume["secret"]["secretName"] == key["name"]
    assert volume["secret"]["items"] == [{"key": key["key"], "path": password.name}]


def test_stamped_series_carry_the_labels_the_rules_group_by():
    registry = CollectorRegistry()
    Counter("meshscope_steps", "steps", ["kind"], registry=registry).labels(kind="x").inc()
    port = free_port_range(1)
    labels = {"job": RANK_JOB, "run": "moe-train", "rank": "13", "node": "pod-1"}
    server, _ = serve_metrics(registry, port, labels=labels)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert samples and all(s.labels.items() >= labels.items() for s in samples), samples
    assert any(s.labels.get("kind") == "x" for s in samples)  # its own labels kept
