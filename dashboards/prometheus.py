"""Prometheus configuration for meshscope runs: file_sd over every run's targets.json."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from collector.exporter import TARGETS_INDEX

RULES = Path(__file__).parent / "rules" / "rules.yml"


def prometheus_config(runs_root: Path, *, scrape_interval_s: float = 5.0,
                      rule_files: list[str] | None = None,
                      alertmanager: str | None = None) -> dict[str, Any]:
    """Scrape every rank of every run under `runs_root`; topology comes from target labels."""
    interval = f"{scrape_interval_s:g}s"
    config: dict[str, Any] = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [{
            "job_name": "meshscope",
            "file_sd_configs": [{"files": [str(Path(runs_root).resolve() / TARGETS_INDEX / "*.json")],
                                 "refresh_interval": interval}],
        }],
    }
    if rule_files:
        config["rule_files"] = rule_files
    if alertmanager:
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
    return config


def write_prometheus_config(path: Path, runs_root: Path, **kwargs: Any) -> Path:
    """Write the config (JSON is valid YAML, so no YAML library is needed)."""
    path.write_text(json.dumps(prometheus_config(runs_root, **kwargs), indent=2))
    return path
