"""`meshscope run` with a poisoned module: the tracer names it, and `meshscope replay` re-runs it."""

from __future__ import annotations

import pytest

from fixtures.ports import free_port_range
from fixtures.runs import meshscope, start_run
from meshscope.collector.store import load_events


@pytest.mark.parametrize("where,tensor,replays", [("forward", "parameter", 0), ("backward", "gradient", 1)])
@pytest.mark.parametrize("device", ["cpu", "sim"])  # gloo, and NCCL's semantics (simnccl)
def test_the_tracer_names_the_poisoned_module_and_rank(tmp_path, where, tensor, replays, device):
    module = "blocks.1.moe.router.gate"
    proc = start_run(
        tmp_path,
        "t",
        free_port_range(3),
        "--device",
        device,
        "--steps",
        "10",
        "--inject",
        f"nan@step=4,rank=1,module={module},where={where}",
    )
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    events = load_events(tmp_path / "t")
    nans = events[events["kind"] == "nan"].sort_values(["step", "id"])
    # The first finding is the fault. On the simulated device (the host runs ahead of its
    # stream) a busy host can let the poisoned update reach the peers before the flag lands;
    # their findings then come later and are downstream. On the CPU nothing spreads.
    told = nans[["rank", "step", "detail"]].to_dict("records")
    assert len(nans) == 1 if device == "cpu" else len(nans) >= 1 and (nans["step"].iloc[1:] > 4).all(), told
    row = nans.iloc[0]
    detail = row["detail"]
    assert (row["rank"], row["step"]) == (1, 4)
    assert (detail["module"], detail["where"], detail["tensor"]) == (module, where, tensor)
    snapshots = events[events["kind"] == "snapshot"]
    paths = [d["path"] for d in snapshots["detail"]]
    assert detail["snapshot"] in paths and (len(paths) == 1 or device == "sim"), paths
    # forward: the Inf weight is in the snapshot, so the re-run gives Inf again (exit 0);
    # backward: the NaN came from a hook, not the module, and replay says so (exit 1)
    replay = meshscope("replay", detail["snapshot"])
    assert replay.returncode == replays, replay.stdout + replay.stderr
    assert module in replay.stdout


def _ep_run(tmp_path, injection: str, *args: str):
    """A 2-rank expert-parallel run with `injection`: its events, and the placed `nan`
    findings as (rank, step, module, experts, where, tensor)."""
    proc = start_run(
        tmp_path,
        "ep",
        free_port_range(3),
        *("--set", "parallel.ep=2", "--inject", injection, *args),
    )
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    events = load_events(tmp_path / "ep")
    nans = events[events["kind"] == "nan"]
    placed = [
        (int(r), int(s), d["module"], d["experts"], d["where"], d["tensor"])
        for r, s, d in zip(nans["rank"], nans["step"], nans["detail"])
        if d["module"]
    ]
    return events, placed


def test_under_expert_parallelism_the_holder_finds_a_poisoned_expert_in_its_own_weights(tmp_path):
    """No re-run is possible under expert parallelism (it needs every EP peer), yet the rank
    holding expert 2 finds it in its own weights: the module and the layer's expert number.
    Every rank's loss is NaN (the expert's output went back to every sender): the anomaly
    names no rank, root cause names the holder."""
    from meshscope.explain.ranking import explain

    events, placed = _ep_run(tmp_path, "nan@step=4,rank=1,module=blocks.1.moe.experts.2", "--steps", "10")
    assert placed == [(1, 4, "blocks.1.moe.experts", [2], "forward", "parameter")], events
    anomalies = [d for d in events[events["kind"] == "anomaly"]["detail"] if d["type"] == "nan"]
    assert [a["ranks"] for a in anomalies] == [[]], anomalies
    causes = explain(tmp_path / "ep")
    assert causes[0].kind == "nonfinite" and causes[0].ranks == [1], [
        (c.kind, c.ranks, c.title) for c in causes
    ]
    assert "expert 2" in causes[0].title


def test_full_tracing_under_expert_parallelism_never_names_the_rank_a_nan_only_reached(tmp_path):
    """`--trace full` hooks every module on every step: rank 0's poisoned attention is found
    there, and rank 1, whose experts only received the NaN through the exchange, names no
    module (before, it named its experts' input, and root cause named both ranks)."""
    from meshscope.explain.ranking import explain

    events, found = _ep_run(
        tmp_path, "nan@step=3,rank=0,module=blocks.0.attn", "--steps", "6", "--trace", "full"
    )
    assert found == [(0, 3, "blocks.0.attn", [], "forward", "parameter")], events[events["kind"] == "nan"]
    causes = explain(tmp_path / "ep")
    assert causes[0].kind == "nonfinite" and causes[0].ranks == [0], [
        (c.kind, c.ranks, c.title) for c in causes
    ]


def test_under_expert_parallelism_the_rank_whose_own_layers_made_a_nan_in_backward_is_named(tmp_path):
    """A NaN made outside the experts (in `blocks.1.attn`'s backward) on rank 1, from finite
    weights: no re-run is possible, but rank 1 saw its own layers send a NaN gradient to the
    experts while all that came back to them was finite, and names the layer whose exchange
    first carried it (`blocks.0.moe`, the next below in backward order). Rank 0, whose layers
    only saw what came back, places nothing; root cause names rank 1."""
    from meshscope.explain.ranking import explain

    events, found = _ep_run(tmp_path, "nan@step=3,rank=1,module=blocks.1.attn,where=backward", "--steps", "6")
    nans = events[events["kind"] == "nan"][["rank", "step", "detail"]].to_string()
    assert found == [(1, 3, "blocks.0.moe", [], "backward", "input")], nans
    causes = explain(tmp_path / "ep")
    assert causes[0].kind == "nonfinite" and causes[0].ranks == [1], [
        (c.kind, c.ranks, c.title) for c in causes
    ]


@pytest.mark.parametrize("device", ["cpu", "sim"])  # gloo, and NCCL's semantics (simnccl)
def test_under_expert_parallelism_the_holder_places_a_nan_its_expert_made_in_backward(tmp_path, device):
    """A NaN made in expert 1's backward on its holder (rank 0), from finite weights and a
    finite incoming gradient: no re-run is possible and no weight is bad, yet the holder saw
    its experts take a finite gradient in and give a NaN out at the layer's exchanges, and
    names them. Every rank's loss and gradient norm go non-finite; only the holder is named."""
    from meshscope.explain.ranking import explain

    injection = "nan@step=3,rank=0,module=blocks.0.moe.experts.1,where=backward"
    events, placed = _ep_run(tmp_path, injection, "--device", device, "--steps", "8")
    assert placed == [(0, 3, "blocks.0.moe.experts", [1], "backward", "gradient")], events
    causes = explain(tmp_path / "ep")
    told = [(c.kind, c.ranks, c.title) for c in causes]
    assert causes[0].kind == "nonfinite" and causes[0].ranks == [0], told
    assert "expert 1" in causes[0].title
