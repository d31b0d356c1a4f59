"""`meshscope run` under a hung or broken collective: the culprit named, the run ends."""

from __future__ import annotations

import pytest

from fixtures.ports import free_port_range
from fixtures.runs import meshscope, start_run
from meshscope.collector.store import load_events


@pytest.mark.parametrize(
    "nproc,inject,kind,collective",
    [
        (3, "skip_collective@step=5,rank=2", "desync", ("all_reduce", "0")),
        (3, "collective_mismatch@step=5,rank=2,what=op", "mismatch", ("broadcast", "0")),
        (3, "hang@step=5,rank=2,seconds=600", "compute", ("all_reduce", "0")),
        # two ranks: no majority to outvote the culprit; the program order of a step both ran
        # alike says which collective was skipped
        (2, "skip_collective@step=5,rank=1", "missing", ("all_reduce", "0")),
    ],
)
def test_abort_names_the_culprit_and_the_run_resumes(tmp_path, nproc, inject, kind, collective):
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
    )
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]
    events = load_events(tmp_path / "h")
    hangs = events[events["kind"] == "hang"]
    assert len(hangs) == 1, out[-2000:]
    detail = hangs.iloc[0]["detail"]
    assert detail["culprit_ranks"] == [culprit] and detail["type"] == kind, detail["why"]
    assert (detail["op"], detail["group"]) == collective, detail
    assert detail["action"] == "abort" and set(detail["stacks"]) >= {"0", "1"}
    assert detail["detected_at"] - detail["stalled_since"] < 10
    kinds = events["kind"].tolist()
    assert "resume" in kinds and kinds[-1] == "run_end"  # restarted from a checkpoint, finished
    report = meshscope("hang-report", "--run", str(tmp_path / "h"))
    assert report.returncode == 0 and f"[{culprit}]" in report.stdout
