"""`meshscope run` under a hung or broken collective: the culprit named, the run ends."""

from __future__ import annotations

import pytest

from fixtures.ports import free_port_range
from fixtures.runs import meshscope, sample, scrape, start_run, wait_for
from meshscope.collector.report import efficiency
from meshscope.collector.store import load_events


@pytest.mark.parametrize(
    "nproc,inject,kind,collective,flags",
    [
        (3, "skip_collective@step=5,rank=2", "desync", ("all_reduce", "0"), ()),
        (3, "collective_mismatch@step=5,rank=2,what=op", "mismatch", ("broadcast", "0"), ()),
        (3, "hang@step=5,rank=2,seconds=600", "compute", ("all_reduce", "0"), ()),
        # two ranks: no majority to outvote the culprit. It skips the gradient all-reduce and
        # runs on into the control plane's collectives; its own habit (one reduction a step)
        # says which rank broke step, not the rank that waits longest
        (2, "skip_collective@step=5,rank=1", "desync", ("all_reduce", "0"), ()),
        # a desync inside the expert all-to-all: the skipper's combine pairs with its peer's
        # dispatch, and only the call sites (dispatch vs combine) tell
        (
            2,
            "skip_collective@step=7,rank=1,of=experts",  # a crash: the step-4 save is long done
            "desync",
            ("all_to_all_single", None),
            ("--set", "parallel.ep=2"),
        ),
        # expert parallelism: the peer waits in the expert all-to-all of the first MoE layer
        (
            2,
            "hang@step=5,rank=1,seconds=600",
            "compute",
            ("all_to_all_single", None),
            ("--set", "parallel.ep=2"),
        ),
        # a router that miscounts: the culprit's dropless dispatch sends wrong split sizes
        (
            2,
            "collective_mismatch@step=5,rank=1,what=split",
            "mismatch",
            ("all_to_all_single", None),
            ("--set", "parallel.ep=2", "--set", "parallel.dispatch=dropless"),
        ),
    ],
    ids=[
        "desync",
        "mismatch",
        "compute",
        "desync-of-two",
        "desync-in-expert-all-to-all",
        "compute-in-expert-all-to-all",
        "wrong-expert-splits",
    ],
)
def test_abort_names_the_culprit_and_the_run_resumes(tmp_path, nproc, inject, kind, collective, flags):
    culprit = nproc - 1
    port = free_port_range(nproc + 1)
    proc = start_run(
        tmp_path,
        "h",
        port,
        "--nproc",
        str(nproc),
        "--steps",
        "14",
        "--inject",
        inject,
        "--checkpoint-every",
        "4",
        "--max-restarts",
        "1",
        "--on-hang",
        "abort",
        *flags,
    )
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]
    events = load_events(tmp_path / "h")
    hangs = events[events["kind"] == "hang"]
    assert len(hangs) == 1, out[-2000:]
    detail = hangs.iloc[0]["detail"]
    assert detail["culprit_ranks"] == [culprit] and detail["type"] == kind, detail["why"]
    op, group = collective
    assert detail["op"] == op and group in (None, detail["group"]), detail  # EP: a group of its own
    assert detail["action"] == "abort"
    # wrong splits (and a combine paired with a dispatch) break gloo's exchange at once: both
    # ranks end with its error, no stack to take
    crashes = "split sizes" in detail["why"] or "of=experts" in inject
    assert set(detail["stacks"]) >= {"0", "1"} or crashes, detail
    assert detail["detected_at"] - detail["stalled_since"] < 10
    # the header's step is where the fault happened, not how far a rank that skipped ran on
    assert hangs.iloc[0]["step"] == int(inject.split("step=")[1].split(",")[0]), detail["why"]
    # restarted from a checkpoint, finished. The verdict itself may land after the restart: wrong
    # splits crash gloo at once, the agent restarts, and the post-mortem of the logs ends later
    kinds = [k for k in events["kind"] if k != "hang"]
    assert "resume" in kinds and kinds[-1] == "run_end", kinds
    # the ranks the watchdog aborted on purpose are no dead-rank faults (its hang event says it)
    assert crashes or "fault" not in kinds, events[events["kind"] == "fault"]["detail"].tolist()
    # where the time went: the stall to the abort is the hang's, and the buckets add up
    account = efficiency(tmp_path / "h")["account"]
    for rank, buckets in account.ranks.items():
        assert sum(buckets.values()) == pytest.approx(account.wall_s), rank
    stalled = detail["detected_at"] - detail["stalled_since"]
    if not crashes:  # a crash is no stall: its time is the restart's
        assert max(b["hang"] for b in account.ranks.values()) >= stalled - 0.05, (stalled, account.ranks)
    assert account.job["restart"] > 0 and account.job["wasted_progress"] >= 0, account.job
    report = meshscope("hang-report", "--run", str(tmp_path / "h"))
    assert report.returncode == 0 and f"[{culprit}]" in report.stdout
    if kind == "desync":  # the verdict reaches root cause as the watchdog said it
        causes = meshscope("explain", "--run", str(tmp_path / "h"))
        first = next(line for line in causes.stdout.splitlines() if line.startswith("1. "))
        assert f"rank {culprit}: desync" in first, causes.stdout


def test_a_stuck_transport_on_a_device_is_a_hang_with_its_metric(tmp_path):
    # The simulated accelerator: collectives return at once and the hosts run on after the
    # culprit's stream stops; only device truth (events) shows the stall.
    port = free_port_range(4)
    proc = start_run(
        tmp_path,
        "s",
        port,
        *("--device", "sim", "--nproc", "3", "--steps", "14", "--checkpoint-every", "4"),
        *("--inject", "stream_hang@step=5,rank=2", "--max-restarts", "1", "--on-hang", "abort"),
    )
    counted = None
    try:
        counted = wait_for(
            lambda: (f := scrape(port + 3)) and sample(f, "meshscope_faults", "_total", kind="hang"), 120
        )
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert counted == 1, "meshscope_faults_total{kind=hang} never counted the stuck transport"
    assert proc.returncode == 0, out[-3000:]
    events = load_events(tmp_path / "s")
    (detail,) = events[events["kind"] == "hang"]["detail"]
    assert detail["type"] == "stuck" and detail["source"] == "device events", detail["why"]
    assert detail["waiting_ranks"] == [0, 1, 2] and detail["op"] == "all_reduce", detail
    assert detail["step"] == 5 and detail["host_step"] >= 5, detail  # the device's step, not the host's
    assert "resume" in events["kind"].tolist()
