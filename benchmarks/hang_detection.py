"""Hang detection: seconds from the stall to the culprit named, against the process group's own
timeout, in the same run.

Each scenario runs on 3 ranks (the culprit is rank 2, misbehaving at step 3; see
fixtures/hang_cases.py) with flight logs and meshscope's watchdog at its default settings, on
each backend of `--backends`: gloo (the host completes collectives) and simnccl (the simulated
accelerator: collectives return at once and complete on a stream; device truth from events).
On gloo it also runs plain, with the process group's timeout set to `--pg-timeout`. For the
watchdog: delay from the stall (the last progress of any rank) to the diagnosis, and whether
rank and collective are right (`transport`: everyone is in the collective, so no rank is to
blame: right is "stuck" with every rank waiting). For the plain job: when its first rank
errored (timeout or a broken connection), measured from the culprit's fault, and whether the
error names the culprit.

    .venv/bin/python benchmarks/hang_detection.py [--repeats 1 --pg-timeout 20 --backends gloo,simnccl]
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
from meshscope.watchdog.config import HangConfig
from meshscope.watchdog.watch import HangWatch

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
    "transport": "stuck",
}


def _spawn(
    live: Path,
    scenario: str,
    pg_timeout: float,
    flight: bool,
    backend: str = "gloo",
    world: int = WORLD,
    recorder: bool = False,
) -> list:
    ctx = mp.get_context("spawn")
    port = free_port_range(1)
    procs = [
        ctx.Process(
            target=rank_main,
            args=(r, world, port, str(live), scenario, pg_timeout, flight, backend, recorder),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    return procs


def _end(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(10)


def watched(
    scenario: str, pg_timeout: float, backend: str = "gloo", world: int = WORLD, recorder: bool = False
) -> dict:
    """The watchdog at its defaults on one scenario: delay, verdict, and whether it is right
    (`recorder`: PyTorch's Flight Recorder on too, asked for on demand)."""
    culprit = world - 1
    with tempfile.TemporaryDirectory() as tmp:
        live = Path(tmp) / "live"
        procs = _spawn(
            live, scenario, pg_timeout, flight=True, backend=backend, world=world, recorder=recorder
        )
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
    # transport: nobody's code is at fault ([]), unless a Flight Recorder saw the culprit's
    # device never start the collective
    culprits = ([], [culprit]) if scenario == "transport" else ([culprit],)
    right = (
        d["culprit_ranks"] in culprits
        and d["type"] == EXPECTED[scenario]
        and (d["seq"] == FAULT_STEP or d["type"] in ("dead", "error"))
    )
    return {
        "named": right,
        "delay_s": d["detected_at"] - d["stalled_since"],
        "kind": d["type"],
        "why": d["why"],
        "source": d.get("source"),
        "flight_recorder": d.get("flight_recorder"),
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
    parser.add_argument("--backends", default="gloo,simnccl")
    args = parser.parse_args()
    print(
        f"# {machine()}\n# 3 ranks, culprit rank {CULPRIT} at step {FAULT_STEP}; "
        f"watchdog defaults {HangConfig()}; plain process-group timeout {args.pg_timeout:g} s (gloo)"
    )
    print(
        f"{'scenario':10} {'backend':8} {'watchdog':>10} {'right':>6}  {'plain job':>10} {'named':>6}  "
        "plain job's first error"
    )
    delays: dict[str, list[float]] = {}
    for scenario in args.scenarios.split(","):
        for backend in args.backends.split(","):
            for _ in range(args.repeats):
                w = watched(scenario, args.pg_timeout, backend)
                delays.setdefault(backend, []).append(w["delay_s"])
                p = (
                    plain(scenario, args.pg_timeout)
                    if backend == "gloo" and scenario != "transport"
                    else None
                )
                plain_cols = (
                    f"{p['delay_s']:9.2f}s {str(p['named']):>6}  {p['error']}" if p else f"{'-':>10} {'-':>6}"
                )
                print(
                    f"{scenario:10} {backend:8} {w['delay_s']:9.2f}s {str(w['named']):>6}  {plain_cols}",
                    flush=True,
                )
    for backend, values in delays.items():
        print(
            f"median watchdog delay on {backend}: {statistics.median(values):.2f} s over {len(values)} runs "
            "(target <= 5 s)"
        )


if __name__ == "__main__":
    main()
