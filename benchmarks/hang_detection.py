"""Hang detection: seconds from the stall to the culprit named, against the process group's own
timeout, in the same run.

Each scenario runs twice on 3 gloo ranks (the culprit is rank 2, misbehaving at step 3; see
fixtures/hang_cases.py): once with flight logs and meshscope's watchdog at its default
settings, once plain with the process group's timeout set to `--pg-timeout`. For the watchdog:
delay from the stall (the last progress of any rank) to the diagnosis, and whether rank and
collective are right. For the plain job: when its first rank errored (timeout or a broken
connection), measured from the culprit's fault, and whether the error names the culprit.

    .venv/bin/python benchmarks/hang_detection.py [--repeats 1 --pg-timeout 20]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

from _common import machine

from fixtures.hang_cases import FAULT_STEP, rank_main
from fixtures.ports import free_port_range
from meshscope.watchdog.watch import HangConfig, HangWatch

WORLD, CULPRIT = 3, 2
EXPECTED = {
    "skip": "desync",
    "compute": "compute",
    "op": "mismatch",
    "shape": "mismatch",
    "dtype": "mismatch",
    "split": "mismatch",
    "kill": "dead",
    "error": "error",
}


def _spawn(live: Path, scenario: str, pg_timeout: float, flight: bool) -> list:
    ctx = mp.get_context("spawn")
    port = free_port_range(1)
    procs = [
        ctx.Process(target=rank_main, args=(r, WORLD, port, str(live), scenario, pg_timeout, flight))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    return procs


def _end(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(10)


def watched(scenario: str, pg_timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        live = Path(tmp) / "live"
        procs = _spawn(live, scenario, pg_timeout, flight=True)
        watch, diag = HangWatch(live, HangConfig()), None
        deadline = time.monotonic() + pg_timeout + 30
        try:
            while diag is None and time.monotonic() < deadline:
                diag = watch.poll()
                time.sleep(watch.config.poll_s)
        finally:
            _end(procs)
    if diag is None:
        return {"named": False, "delay_s": float("nan"), "kind": "none"}
    d = diag.detail()
    right = (
        d["culprit_ranks"] == [CULPRIT]
        and d["type"] == EXPECTED[scenario]
        and (d["seq"] == FAULT_STEP or d["type"] in ("dead", "error"))
    )
    return {
        "named": right,
        "delay_s": d["detected_at"] - d["stalled_since"],
        "kind": d["type"],
        "why": d["why"],
    }


def plain(scenario: str, pg_timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        live = Path(tmp) / "live"
        procs = _spawn(live, scenario, pg_timeout, flight=False)
        deadline = time.monotonic() + pg_timeout + 30
        try:
            while time.monotonic() < deadline and not list(live.glob("exit-rank*.json")):
                time.sleep(0.1)
            time.sleep(0.5)
            exits = [json.loads(p.read_text()) for p in live.glob("exit-rank*.json")]
            fault = (
                float((live / "fault_time").read_text()) if (live / "fault_time").exists() else float("nan")
            )
        finally:
            _end(procs)
    errored = [e for e in exits if e["error"]]
    first = min((e["time"] for e in errored), default=float("nan"))
    return {
        "delay_s": first - fault,
        "named": any(f"rank {CULPRIT}" in e["error"] for e in errored),
        "error": errored[0]["error"][:90] if errored else "(no error: the job still waits)",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--pg-timeout", type=float, default=20.0)
    parser.add_argument("--scenarios", default=",".join(EXPECTED))
    args = parser.parse_args()
    print(
        f"# {machine()}\n# 3 gloo ranks, culprit rank {CULPRIT} at step {FAULT_STEP}; "
        f"watchdog defaults {HangConfig()}; plain process-group timeout {args.pg_timeout:g} s"
    )
    print(
        f"{'scenario':10} {'watchdog':>10} {'right':>6}  {'plain job':>10} {'named':>6}  "
        "plain job's first error"
    )
    delays = []
    for scenario in args.scenarios.split(","):
        for _ in range(args.repeats):
            w, p = watched(scenario, args.pg_timeout), plain(scenario, args.pg_timeout)
            delays.append(w["delay_s"])
            print(
                f"{scenario:10} {w['delay_s']:9.2f}s {str(w['named']):>6}  "
                f"{p['delay_s']:9.2f}s {str(p['named']):>6}  {p['error']}",
                flush=True,
            )
    print(f"median watchdog delay {statistics.median(delays):.2f} s over {len(delays)} runs (target <= 5 s)")


if __name__ == "__main__":
    main()
