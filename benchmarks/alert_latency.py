"""Alert latency: from an injected fault's first step to the Slack-style webhook delivery.

`meshscope stack up` (Prometheus with our rules, Alertmanager with our routing; 1 s scrape and
rule evaluation, 1 s group wait) watches N runs of 2 CPU ranks, one after the other. Each run
slows rank 1 four-fold from step 1500 (StragglerRank, warning) and poisons rank 1's loss at step
1800 (LossNotFinite, critical). Latency = webhook arrival time - wall time at which that step
began on the faulty rank (its StepRecord). The detectors' own AnomalyDetected is timed too.
p50 over the runs; target p50 <= 10 s.

The faults come late because Prometheus sees a new run's targets only 5-10 s after their
file_sd file appears (its discovery and scrape managers each apply updates at most every 5 s);
a fault that begins before the run's first scrape is reported as such, never timed.

    .venv/bin/python benchmarks/alert_latency.py [--runs 3] [--set monitor.record_every_s=0.5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

from _common import REPO, machine

from fixtures.ports import free_port_range
from fixtures.sinks import Sink
from meshscope.alerts.config import AlertRouting
from meshscope.collector.store import load_steps
from meshscope.dashboards.stack import StackConfig, down, up

SLOW_AT, NAN_AT, STEPS = 1500, 1800, 1850
ALERTS = {"StragglerRank": SLOW_AT, "AnomalyDetected": SLOW_AT, "LossNotFinite": NAN_AT}


def deliveries(sink: Sink, run_id: str, alertname: str) -> list[float]:
    """Arrival times of the sink's FIRING notifications of this alert for this run."""
    return [
        at
        for text, at in zip(sink.texts(), list(sink.times))
        if alertname in text and f"run {run_id}" in text and "FIRING" in text
    ]


def first_scrape(prometheus_port: int, run_id: str) -> float:
    """Wall time of the run's first scrape that both ranks answered (a fault before it is unseen)."""
    query = f'min(min_over_time(timestamp(up{{job="meshscope",run="{run_id}"}} == 1)[10m:1s]))'
    url = f"http://127.0.0.1:{prometheus_port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    result = json.load(urllib.request.urlopen(url, timeout=10))["data"]["result"]
    return float(result[0]["value"][1]) if result else float("inf")


def one_run(
    runs: Path, run_id: str, sink: Sink, prometheus_port: int, settings: list[str]
) -> dict[str, float]:
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
        str(STEPS),
        *[arg for setting in settings for arg in ("--set", setting)],
        "--inject",
        f"slow@step={SLOW_AT},rank=1,steps=120,factor=4",
        "--inject",
        f"nan@step={NAN_AT},rank=1",
        "--linger",
        "20",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    proc.wait(timeout=300)  # its 20 s linger keeps the ranks scraped while the pages arrive
    steps = load_steps(runs / run_id)
    began = steps[steps["rank"] == 1].set_index("step")["time"]
    scraped = first_scrape(prometheus_port, run_id)
    if scraped > float(began.loc[SLOW_AT]):
        raise SystemExit(
            f"{run_id}: the fault began {scraped - began.loc[SLOW_AT]:.1f} s before the first scrape"
        )
    out = {}
    for alert, step in ALERTS.items():
        fault_at = float(began.loc[step])
        pages = deliveries(sink, run_id, alert)
        after = [at for at in pages if at >= fault_at]
        out[alert] = after[0] - fault_at if after else float("nan")
        if len(after) < len(pages):  # another episode of the run paged first: said, never timed
            print(f"{run_id}: {alert} paged {len(pages) - len(after)} time(s) before its fault", flush=True)
    print(f"{run_id}: first scrape {began.loc[SLOW_AT] - scraped:.1f} s before the fault", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], help="a run setting, as `meshscope run --set`")
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
            r = one_run(tmp / "runs", f"latency-{i}", sink, port, args.set)
            results.append(r)
            print(f"run {i}: " + "  ".join(f"{k} {v:.1f} s" for k, v in r.items()), flush=True)
    finally:
        down(cfg.home)
        sink.stop()
    print(f"\nmachine: {machine()}; settings: {args.set or 'defaults'}")
    for alert in ALERTS:
        values = [r[alert] for r in results]
        print(
            f"{alert:16} p50 {statistics.median(values):.1f} s  (runs: "
            + ", ".join(f"{v:.1f}" for v in values)
            + ")  target p50 <= 10 s"
        )


if __name__ == "__main__":
    main()
