"""The README's Kubernetes manifests hold together with the code: every flag exists, every port
the code opens is declared and scraped, the selectors meet, the job store is the Service, and
the series a PodMonitor scrapes carry the labels the rules and boards group by."""

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
from meshscope.config import RunConfig

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict]:
    section = README.read_text().split("### Kubernetes", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)[1]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(block)}


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
    assert "metrics_labels=true" in flags["set"]
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
