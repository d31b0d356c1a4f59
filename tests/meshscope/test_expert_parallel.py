"""`meshscope run` under expert parallelism with live re-placement: a skewed router makes one
rank's experts carry more tokens, the sidecar proposes a placement, every rank moves the
experts at one step boundary, and the per-rank load evens out; the store says what moved."""

from __future__ import annotations

import numpy as np

from fixtures.runs import meshscope, start_run
from meshscope.collector.controls import load_controls
from meshscope.collector.store import load_events, load_expert_work


def test_a_skewed_router_is_re_placed_live_and_the_ranks_even_out(tmp_path):
    proc = start_run(
        tmp_path,
        "rb",
        None,
        *("--nproc", "2", "--steps", "120", "--set", "parallel.ep=2", "--set", "parallel.dispatch=dropless"),
        *("--set", "parallel.replace_threshold=1.15", "--set", "parallel.replace_cooldown=30"),
        *("--set", "model.router_skew=2"),  # every token prefers expert 0: rank 0's experts are hot
    )
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    run = tmp_path / "rb"
    applied = load_controls(run)
    applied = applied[(applied["kind"] == "expert_placement") & (applied["status"] == "applied")]
    assert len(applied), out[-2000:]
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
