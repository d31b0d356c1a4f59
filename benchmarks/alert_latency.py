"""Alert latency: from an injected fault's first step to the Slack-style webhook delivery.

`meshscope stack up` (Prometheus with our rules, Alertmanager with our routing; 1 s scrape and
rule evaluation, 1 s group wait) watches N runs of 2 CPU ranks, one after the other. Each run
slows rank 1 four-fold from step 40 (StragglerRank, warning) and poisons rank 1's loss at step
170 (LossNotFinite, critical). Latency = webhook arrival time - wall time at which that step
began on the faulty rank (its StepRecord). The detectors' own AnomalyDetected is timed too.
p50 over the runs; target p50 <= 10 s.

    .venv/bin/python benchmarks/alert_latency.py [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, machine

from fixtures.ports import free_port_range
from fixtures.sinks import Sink
from meshscope.alerts.config import AlertRouting
from meshscope.collector.store import load_steps
from meshscope.dashboards.stack import StackConfig, down, up

SLOW_AT, NAN_AT = 40, 170
ALERTS = {"StragglerRank": SLOW_AT, "AnomalyDetected": SLOW_AT, "LossNotFinite": NAN_AT}


def first_delivery(sink: Sink, run_id: str, alertname: str) -> float | None:
    for text, at in zip(sink.texts(), list(sink.times)):
        if alertname in text and f"run {run_id}" in text and "FIRING" in text:
            return at
    return None


def one_run(runs: Path, run_id: str, sink: Sink) -> dict[str, float]:
    port = free_port_range(3)
    cmd = [
        sys.executable,
        "-m",
        "meshscope",
        "run",
        "--config",
        str(REPO / "fixtures/tiny.toml"),
        "--run-dir",
        str(runs),
        "--run-id",
        run_id,
        "--metrics-port",
        str(port),
        "--steps",
        "200",
        "--inject",
        f"slow@step={SLOW_AT},rank=1,steps=120,factor=4",
        "--inject",
        f"nan@step={NAN_AT},rank=1",
        "--linger",
        "20",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not all(first_delivery(sink, run_id, a) for a in ALERTS):
        time.sleep(0.2)
    proc.wait(timeout=120)
    steps = load_steps(runs / run_id)
    began = steps[steps["rank"] == 1].set_index("step")["time"]
    out = {}
    for alert, step in ALERTS.items():
        at = first_delivery(sink, run_id, alert)
        out[alert] = at - float(began.loc[step]) if at else float("nan")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="alert-latency-"))
    sink = Sink().start()
    hook = tmp / "hook"
    hook.write_text(sink.url)
    port = free_port_range(2)
    cfg = StackConfig(
        runs_root=tmp / "runs",
        home=tmp / "stack",
        prometheus_port=port,
        alertmanager_port=port + 1,
        scrape_interval_s=1.0,
        routing=AlertRouting(slack_webhook_file=hook),
        fast=True,
    )
    (tmp / "runs").mkdir()
    up(cfg)
    results = []
    try:
        for i in range(args.runs):
            r = one_run(tmp / "runs", f"latency-{i}", sink)
            results.append(r)
            print(f"run {i}: " + "  ".join(f"{k} {v:.1f} s" for k, v in r.items()), flush=True)
    finally:
        down(cfg.home)
        sink.stop()
    print(f"\nmachine: {machine()}")
    for alert in ALERTS:
        values = [r[alert] for r in results]
        print(
            f"{alert:16} p50 {statistics.median(values):.1f} s  (runs: "
            + ", ".join(f"{v:.1f}" for v in values)
            + ")  target p50 <= 10 s"
        )


if __name__ == "__main__":
    main()
