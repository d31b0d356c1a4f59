"""`meshscope run` under expert parallelism with live re-placement: a skewed router makes one
rank's experts carry more tokens, the sidecar proposes a placement, every rank moves the
experts at one step boundary, and the per-rank load evens out; the store says what moved."""

from __future__ import annotations

import signal

import numpy as np

from fixtures.runs import meshscope, start_run, wait_for
from meshscope.collector.controls import load_controls
from meshscope.collector.store import latest_step, load_events, load_expert_work


def _applied(run):
    """The expert placements the trainer applied, oldest first."""
    try:
        rows = load_controls(run)
    except FileNotFoundError:
        return []
    return rows[(rows["kind"] == "expert_placement") & (rows["status"] == "applied")]


def test_a_skewed_router_is_re_placed_live_and_the_ranks_even_out(tmp_path):
    proc = start_run(
        tmp_path,
        "rb",
        None,
        *(
            "--nproc",
            "2",
            "--steps",
            "1000000",
            "--set",
            "parallel.ep=2",
            "--set",
            "parallel.dispatch=dropless",
        ),
        *("--set", "parallel.replace_threshold=1.15", "--set", "parallel.replace_cooldown=30"),
        *("--set", "model.router_skew=2"),  # every token prefers expert 0: rank 0's experts are hot
    )
    run = tmp_path / "rb"

    def moved_and_ran_on() -> bool:  # however fast the machine: a move, then 40 steps after it
        done = _applied(run)
        return bool(len(done)) and latest_step(run, rank=None) >= int(done["step"].min()) + 40

    try:
        moved = wait_for(moved_and_ran_on, 180)
    finally:
        proc.send_signal(signal.SIGTERM)  # as a scheduler ends a job
        out, _ = proc.communicate(timeout=180)
    assert moved, out[-3000:]
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    applied = _applied(run)
    first = applied.iloc[0]
    layer, at = int(first["layer"]), int(first["step"])
    events = load_events(run)
    proposed = [
        d for d in events[events["kind"] == "placement_proposed"]["detail"] if d["control"] == first["id"]
    ]
    assert proposed and proposed[0]["max_over_mean_after"] < proposed[0]["max_over_mean_before"]
    moves = [
        d["new"][str(layer)]
        for d in events[events["kind"] == "suggestion_applied"]["detail"]
        if d["control"] == first["id"]
    ]
    assert moves and moves[0]["moved"] and moves[0]["bytes"] > 0  # weights and moments went, checksummed
    # what the ranks' experts processed in that layer, before and after the move
    work = load_expert_work(run)
    work = work[work["layer"] == layer].pivot_table(index="step", columns="rank", values="tokens")
    ratio = work.max(axis=1) / work.mean(axis=1)
    before, after = ratio[ratio.index < at], ratio[ratio.index > at + 5]
    assert len(before) and len(after) and np.median(after) < np.median(before), (before, after)
    explained = meshscope("explain", "--run", str(run))
    assert explained.returncode == 0, explained.stderr
