"""Prometheus configuration for meshscope runs: file_sd over every run's targets.json."""

from __future__ import annotations

import json
import string
import sys
from pathlib import Path
from typing import Any

from meshscope.collector.exporter import TARGETS_INDEX
from meshscope.detectors.thresholds import Thresholds

RULES = Path(__file__).parent / "rules" / "rules.yml"
RULES_TEMPLATE = RULES.with_name("rules.template.yml")


class _RulesTemplate(string.Template):
    delimiter = "%%"  # `$` belongs to Prometheus' own templates ({{ $labels.run }})


def render_rules(thresholds: Thresholds | None = None) -> str:
    """rules.yml with the thresholds the engine uses: one source for both."""
    values = (thresholds or Thresholds()).model_dump()
    template = _RulesTemplate(RULES_TEMPLATE.read_text())
    header = "# GENERATED from rules.template.yml and detectors/thresholds.py: edit those.\n"
    return header + template.substitute({k: f"{v:g}" for k, v in values.items()})


def write_rules(path: Path, thresholds: Thresholds | None = None) -> Path:
    """Write the rendered rules where a Prometheus reads them."""
    path.write_text(render_rules(thresholds))
    return path


def prometheus_config(
    runs_root: Path,
    *,
    scrape_interval_s: float = 5.0,
    rule_files: list[str] | None = None,
    alertmanager: str | None = None,
    remote_write: str | None = None,
) -> dict[str, Any]:
    """Scrape every rank of every run under `runs_root`; topology comes from target labels;
    `remote_write` ships every sample on to a long-term store (VictoriaMetrics)."""
    interval = f"{scrape_interval_s:g}s"
    config: dict[str, Any] = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {
                "job_name": "meshscope",
                "file_sd_configs": [
                    {
                        "files": [str(Path(runs_root).resolve() / TARGETS_INDEX / "*.json")],
                        "refresh_interval": interval,
                    }
                ],
            }
        ],
    }
    if rule_files:
        config["rule_files"] = rule_files
    if remote_write:
        config["remote_write"] = [{"url": remote_write}]
    if alertmanager:
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
    return config


def write_prometheus_config(path: Path, runs_root: Path, **kwargs: Any) -> Path:
    """Write the config (JSON is valid YAML, so no YAML library is needed)."""
    path.write_text(json.dumps(prometheus_config(runs_root, **kwargs), indent=2))
    return path


def prometheus_rule(thresholds: Thresholds | None = None) -> str:
    """The same rules as a Prometheus operator's PrometheusRule (deploy/kubernetes/), picked by
    the Prometheus of monitoring.yaml through its label."""
    import yaml

    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "meshscope", "labels": {"meshscope.io/rules": "true"}},
        "spec": {"groups": yaml.safe_load(render_rules(thresholds))["groups"]},
    }
    header = "# GENERATED from rules.template.yml: python -m meshscope.dashboards.prometheus --write-rules\n"
    return header + yaml.safe_dump(rule, sort_keys=False, width=200)


if __name__ == "__main__":  # python -m meshscope.dashboards.prometheus --write-rules
    if sys.argv[1:] != ["--write-rules"]:
        sys.exit("usage: python -m meshscope.dashboards.prometheus --write-rules")
    print(write_rules(RULES))
    in_repo = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes" / "prometheusrule.yaml"
    in_repo.write_text(prometheus_rule())  # a source checkout's manifests
    print(in_repo)
