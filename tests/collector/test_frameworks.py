"""meshscope inside the frameworks people train with, on CPU ranks under torchrun with the real
libraries: a Hugging Face Trainer and Lightning's DDP strategy train the same with and without
meshscope's callback, and the run it records has every step, its loss, and its phases on the
steps the host times in full."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshscope.collector.flightread import latest_logs, read_flight
from meshscope.collector.monitor_config import HOST_DETAIL_EVERY
from meshscope.collector.store import load_events, load_steps

SCRIPTS = Path(__file__).parent / "scripts"
STEPS = 6


def _train(tmp_path: Path, script: str, with_meshscope: bool) -> tuple[float, Path]:
    """Run `script` on two CPU ranks; rank 0's final weight sum and the run directory."""
    name = "with" if with_meshscope else "without"
    run = tmp_path / name / "run"
    env = dict(
        os.environ,
        WITH_MESHSCOPE="1" if with_meshscope else "0",
        RUN_DIR=str(run),
        OUT_DIR=str(tmp_path / name / "out"),
        STEPS=str(STEPS),
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    weights = [line for line in proc.stdout.splitlines() if line.startswith("WEIGHTS ")]
    assert len(weights) == 1, out[-3000:]
    return float(weights[0].split()[1]), run


def _check_run(run: Path, phases: tuple[str, ...]) -> None:
    steps = load_steps(run)
    assert steps.groupby("rank")["step"].apply(sorted).tolist() == [list(range(STEPS))] * 2, steps
    assert steps["loss"].map(math.isfinite).all() and (steps["loss"] > 0).all(), steps["loss"]
    assert (steps["tokens"] > 0).all() and (steps["step_s"] > 0).all()
    # the host times one step in HOST_DETAIL_EVERY in full (step 0 here); the others' phases are unknown
    timed = steps["step"] % HOST_DETAIL_EVERY == 0
    for phase in phases:
        assert (steps.loc[timed, f"{phase}_s"] > 0).all(), (phase, steps[f"{phase}_s"])
        assert steps.loc[~timed, f"{phase}_s"].isna().all(), (phase, steps[f"{phase}_s"])
    events = load_events(run)
    assert {"run_start", "run_end"} <= set(events["kind"]), events["kind"].tolist()
    # DDP's gradient all-reduce, one record a step, in every rank's flight log
    logs = latest_logs(run / "live")
    assert len(logs) == 2, logs
    for head in logs.values():
        sites = [r.site for r in read_flight(head.path).records]
        assert sum(site.startswith("DDP gradients") for site in sites) >= STEPS, sites


@pytest.mark.parametrize(
    "framework, phases",
    [("hf", ("forward", "backward", "optimizer")), ("lightning", ("forward", "backward", "optimizer"))],
)
def test_a_framework_trains_the_same_with_meshscope_and_every_step_is_recorded(tmp_path, framework, phases):
    pytest.importorskip("transformers" if framework == "hf" else "lightning")
    script = str(SCRIPTS / f"{framework}_train.py")
    plain, _ = _train(tmp_path, script, with_meshscope=False)
    watched, run = _train(tmp_path, script, with_meshscope=True)
    assert watched == plain  # the callback changes nothing the training computes
    _check_run(run, phases)
