"""Post-mortems of Flight Recorder dumps as real jobs leave them: several stuck groups, coalesced
blocks, HCCL naming, a culprit without a dump, device states, and dumps that show no hang."""

from __future__ import annotations

import json

import pytest

from fixtures.fr_dumps import entry, steady, write_dumps
from fixtures.runs import meshscope
from meshscope.watchdog.flight_recorder import diagnose_dumps

WORLD8 = {"0": list(range(8)), "1": [0, 1, 2, 3], "2": [4, 5, 6, 7]}


def _moe_two_stuck_groups(tmp_path, dependent: bool):
    """Eight ranks, two expert groups of four. Group 1 waits for rank 2 (which never entered
    its all-to-all #5); group 2 waits for rank 6 the same way, or, when `dependent`, for rank 5
    which is itself waiting in group 1's collective (so group 2 is stuck because of group 1)."""
    ranks = {}
    for r in range(8):
        group = "1" if r < 4 else "2"
        items = steady(range(1, 5), op="all_to_all", pg=group)
        culprit = 2 if group == "1" else (None if dependent else 6)
        if r != culprit and not (dependent and r == 5):
            items.append(entry(5, "all_to_all", "started", pg=group))
        if dependent and r == 5:
            items.append(entry(5, "all_to_all", "started", pg="1", t_ns=4_900_000))
        ranks[r] = items
    if dependent:  # rank 5 entered group 1 (a wrong-group bug) and never group 2's #5
        for r in (0, 1, 3):
            ranks[r][-1]["time_created_ns"] = 5_000_000
    return write_dumps(tmp_path, ranks, WORLD8)


def test_every_independent_stuck_group_is_reported_with_its_culprits(tmp_path):
    diag = diagnose_dumps(_moe_two_stuck_groups(tmp_path, dependent=False))
    assert diag.culprit_ranks == [2, 6], diag.why
    groups = {g["group"]: g for g in diag.evidence["stuck_groups"]}
    assert groups["1"]["culprit_ranks"] == [2] and groups["2"]["culprit_ranks"] == [6]
    assert groups["1"]["independent"] and groups["2"]["independent"]
    assert "group 1" in diag.why and "group 2" in diag.why


def test_a_coalesced_block_is_one_collective_and_a_size_mismatch_inside_it_is_found(tmp_path):
    ranks = {}
    for r in range(4):
        block = [entry(3, "all_reduce", "started", size=(128,) if r == 1 else (64,), coalesced=True)]
        block += [entry(3, "all_reduce", "started", coalesced=True), entry(3, "coalesced", "started")]
        ranks[r] = steady(range(1, 3)) + block
    diag = diagnose_dumps(write_dumps(tmp_path, ranks, {"0": [0, 1, 2, 3]}))
    assert diag.kind == "mismatch" and diag.culprit_ranks == [1], diag.why
    assert diag.seq == 3 and diag.op.startswith("coalesced[all_reduce,all_reduce"), diag.why


def test_dumps_where_everything_completed_say_no_hang_and_blame_nobody(tmp_path):
    ranks = {r: steady(range(1, 9)) + [entry(9, "coalesced"), entry(9, "all_reduce")] for r in range(4)}
    diag = diagnose_dumps(write_dumps(tmp_path, ranks, {"0": [0, 1, 2, 3]}))
    assert diag.kind == "none" and diag.culprit_ranks == [], diag.why
    assert "no hang" in diag.why


def test_hccl_dumps_without_a_profiling_name_still_name_the_op(tmp_path):
    ranks = {r: steady(range(1, 4), backend="hccl") for r in range(4)}
    for r in (0, 1, 2):
        ranks[r].append(entry(4, "all_gather_into_tensor", "started", backend="hccl"))
    folder = write_dumps(tmp_path, ranks, {"0": [0, 1, 2, 3]}, prefix="hccl_trace_rank_")
    diag = diagnose_dumps(folder)
    assert diag.kind == "missing" and diag.culprit_ranks == [3], diag.why
    assert diag.op == "all_gather_into_tensor" and diag.seq == 4, diag.why
    assert diag.evidence["source"] == "flight recorder"


def test_the_culprit_without_a_dump_is_named_from_its_peers(tmp_path):
    # rank 3 died before it could dump (pytorch#165677): its peers wait in #6, it left nothing
    ranks = {r: steady(range(1, 6)) + [entry(6, "all_reduce", "started")] for r in (0, 1, 2)}
    diag = diagnose_dumps(write_dumps(tmp_path, ranks, {"0": [0, 1, 2, 3]}))
    assert diag.culprit_ranks == [3] and diag.evidence["ranks_without_dump"] == [3], diag.why
    assert (diag.op, diag.seq) == ("all_reduce", 6)


def test_a_rank_whose_device_never_started_the_collective_is_the_culprit(tmp_path):
    ranks = {
        r: steady(range(1, 5)) + [entry(5, "all_reduce", "scheduled" if r == 1 else "started")]
        for r in range(4)
    }
    diag = diagnose_dumps(write_dumps(tmp_path, ranks, {"0": [0, 1, 2, 3]}, as_json=True))
    assert diag.kind == "stuck" and diag.culprit_ranks == [1], diag.why
    assert diag.waiting_ranks == [0, 2, 3] and "never did" in diag.why


@pytest.mark.parametrize("dependent", [True])
def test_a_group_stuck_only_because_of_another_is_not_a_second_culprit(tmp_path, dependent):
    diag = diagnose_dumps(_moe_two_stuck_groups(tmp_path, dependent=dependent))
    groups = {g["group"]: g for g in diag.evidence["stuck_groups"]}
    # group 2 waits on rank 5, which waits in group 1 for rank 2: the root is rank 2 alone
    assert groups["2"]["waiting_on"] == [5] and not groups["2"]["independent"], groups
    assert groups["2"]["culprit_ranks"] == [2], groups
    assert diag.culprit_ranks == [2], diag.why


def test_hang_report_json_is_for_machines(tmp_path):
    ranks = {r: steady(range(1, 6)) + [entry(6, "all_reduce", "started")] for r in (0, 1, 2)}
    ranks[3] = steady(range(1, 6))
    write_dumps(tmp_path, ranks, {"0": [0, 1, 2, 3]})
    out = meshscope("hang-report", "--flight-recorder", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    detail = json.loads(out.stdout)
    assert detail["culprit_ranks"] == [3] and detail["type"] == "missing" and detail["seq"] == 6
