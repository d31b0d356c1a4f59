"""The hang watchdog names the culprit rank and collective, on real gloo ranks."""
from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest

from detectors.hang import HangConfig, HangWatch
from tests.detectors.hang_cases import FAULT_STEP, rank_main
from tests.helpers.ports import free_port_range

WORLD = 3
CULPRIT = WORLD - 1


def watch_scenario(tmp_path: Path, scenario: str, timeout_s: float = 45.0):
    """Run the scenario on 3 ranks and return (diagnosis or None, seconds from the culprit's
    fault to the diagnosis, processes' exit codes)."""
    live = tmp_path / "live"
    ctx = mp.get_context("spawn")
    port = free_port_range(1)
    procs = [ctx.Process(target=rank_main, args=(r, WORLD, port, str(live), scenario))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    watch = HangWatch(live, HangConfig(min_stall_s=1.5, poll_s=0.1, stacks_wait_s=1.0))
    diag, deadline = None, time.monotonic() + timeout_s
    try:
        while diag is None and time.monotonic() < deadline:
            if all(p.exitcode is not None for p in procs) and scenario == "clean":
                break
            diag = watch.poll()
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    return diag


@pytest.mark.parametrize("scenario,kind", [
    ("skip", "desync"), ("compute", "compute"), ("op", "mismatch"), ("shape", "mismatch"),
    ("dtype", "mismatch"), ("split", "mismatch"), ("kill", "dead"), ("error", "error")])
def test_names_the_culprit_rank_and_collective(tmp_path, scenario, kind):
    diag = watch_scenario(tmp_path, scenario)
    assert diag is not None, f"{scenario}: no diagnosis"
    detail = diag.detail()
    assert detail["culprit_ranks"] == [CULPRIT], detail["why"]
    assert detail["type"] == kind, detail["why"]
    assert detail["why"] and str(CULPRIT) in detail["why"]
    if kind in ("desync", "compute", "mismatch"):
        assert detail["seq"] == FAULT_STEP and detail["group"] is not None, detail
        assert detail["op"] in ("all_reduce", "broadcast", "all_to_all_single"), detail
        assert CULPRIT not in detail["waiting_ranks"]


def test_a_rank_in_compute_is_located_by_its_stack(tmp_path):
    diag = watch_scenario(tmp_path, "compute")
    assert "hang_cases.py" in diag.why and "_compute" in diag.why, diag.why
    assert diag.waiting_ranks == [0, 1]
    assert any("_compute" in line for line in diag.stacks[CULPRIT])


def test_a_clean_run_is_not_a_hang(tmp_path):
    assert watch_scenario(tmp_path, "clean", timeout_s=20) is None
