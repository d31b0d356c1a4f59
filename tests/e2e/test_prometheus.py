"""Debian's Prometheus scrapes a live run through the run's file_sd targets."""

import signal
import subprocess

import pytest
import requests

from fixtures.ports import free_port_range
from fixtures.runs import start_run, wait_for
from fixtures.servers import Prometheus
from meshscope.collector.store import latest_step, load_events
from meshscope.dashboards.prometheus import write_prometheus_config
from tests.conftest import require_binary

pytestmark = pytest.mark.e2e


def test_prometheus_scrapes_a_live_run(tmp_path):
    prometheus_bin = require_binary("prometheus")
    promtool = require_binary("promtool")
    runs = tmp_path / "runs"
    runs.mkdir()
    config = write_prometheus_config(tmp_path / "prometheus.yml", runs, scrape_interval_s=1)
    check = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port_range(3)
    with Prometheus(prometheus_bin, config, tmp_path) as prom:
        run = start_run(runs, "e2e", port, "--steps", "40", "--linger", "600")
        try:

            def both_ranks(promql):
                return lambda: (len(r := prom.query(promql)) == 2) and r

            step_time = wait_for(both_ranks('meshscope_step_duration_seconds_count{run="e2e"} > 0'), 150)
            assert step_time, f"no step-time series for both ranks; run exit: {run.poll()}"
            assert {s["metric"]["rank"] for s in step_time} == {"0", "1"}
            assert all(s["metric"]["job"] == "meshscope" for s in step_time)
            assert wait_for(both_ranks('meshscope_comm_ratio{run="e2e"}'), 30)
            experts = wait_for(lambda: prom.query('meshscope_expert_load_ratio{run="e2e"}'), 30)
            assert experts and {s["metric"]["rank"] for s in experts} == {"0"}
            assert len(experts) == 2 * 4  # layer x expert, from rank 0 only
            from meshscope.view.data import live_metrics  # the view's live panel

            def live_ranks():
                d = live_metrics(prom.url, "e2e")
                return sorted(d["rank"]) if len(d) == 2 and d["comm_ratio"].notna().all() else None

            assert wait_for(live_ranks, 30) == ["0", "1"]
            with pytest.raises(OSError, match="Prometheus at"):
                live_metrics(f"http://127.0.0.1:{free_port_range(1)}", "e2e", timeout_s=1)
            body = requests.get(f"http://127.0.0.1:{port + 1}/metrics", timeout=5).content
            lint = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True)
            assert lint.returncode == 0 and lint.stdout + lint.stderr == b""
            # trained to the end, lingering for a last scrape; a SIGTERM (how a scheduler ends a
            # job) ends the linger at once, not after its 600 s
            assert wait_for(lambda: min(latest_step(runs / "e2e", rank=r) for r in (0, 1)) == 39, 60)
        finally:
            run.send_signal(signal.SIGTERM)
            try:
                out, _ = run.communicate(timeout=120)
            finally:
                run.kill()
        assert run.returncode == 128 + signal.SIGTERM and "Traceback" not in out, out[-3000:]
        assert load_events(runs / "e2e", kind="run_end").iloc[0]["detail"]["reason"] == "done"
