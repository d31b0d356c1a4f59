"""The post-mortem finds the root, not the crowd: real Flight Recorder dumps of an 8-rank
pipeline × data × tensor job on gloo (fixtures/fr_gloo, made by `fixtures.fr_jobs`, one case
made afresh here), and NCCL-format dumps of a 16-rank Megatron-style MoE job with pipeline
send/recv on their own groups and on the default group (`fixtures.fr_sim`), faults on two ranks."""

from __future__ import annotations

import random

import pytest

from fixtures import fr_jobs, fr_sim
from fixtures.ports import free_port_range
from meshscope.watchdog import signatures
from meshscope.watchdog.flight_recorder import diagnose_dumps

GLOO = fr_jobs.DUMPS


@pytest.mark.parametrize(
    "case,kind,culprits",
    [
        ("clean", "none", []),
        ("compute_hang", "missing", [5]),
        ("skip_dp_reduction", "missing", [2]),  # a cycle: rank 2 went on to the default group
        ("skip_tensor_all_reduce", "desync", [6]),  # paired silently: only the call sites tell
        ("two_faults", "missing", [1, 2]),  # two roots, every other stuck rank waits on them
    ],
)
def test_real_gloo_dumps_name_the_faulty_ranks_and_no_other(case, kind, culprits):
    assert fr_jobs.CASES[case].keys() == set(culprits)  # the dumps' own truth
    diag = diagnose_dumps(GLOO / case, prefix="rank")
    assert diag.kind == kind and diag.culprit_ranks == culprits, diag.why


def test_other_stuck_groups_wait_on_the_root_and_are_not_culprits():
    diag = diagnose_dumps(GLOO / "compute_hang", prefix="rank")
    ops = {op["group"]: op for op in diag.evidence["stuck_groups"]}
    # rank 6 waits in its expert all-to-all for rank 4, which waits in rank 5's tensor group
    assert ops["7"]["waiting_ranks"] == [6] and ops["7"]["waiting_on"] == [4], ops
    assert ops["7"]["culprit_ranks"] == [5] and not ops["7"]["independent"]
    assert "ranks 4" not in diag.why and "rank 6 waits on it through other ops" in diag.why, diag.why


def test_a_rank_in_an_unrecorded_receive_is_named_with_what_the_backend_cannot_see():
    # gloo records no send/recv: rank 5, left waiting for an activation its pipeline peer never
    # sent, looks exactly like a rank hung in compute (compare compute_hang), and says so
    skipped, hung = (diagnose_dumps(GLOO / c, prefix="rank") for c in ("skip_send", "compute_hang"))
    assert skipped.culprit_ranks == hung.culprit_ranks == [5]
    assert "gloo records no send/recv" in skipped.why


def test_dumps_made_now_by_this_torch_are_read_the_same(tmp_path):
    out = fr_jobs.make_case(tmp_path, fr_jobs.CASES["two_faults"], free_port_range(1))
    assert len(list(out.iterdir())) == fr_jobs.WORLD
    diag = diagnose_dumps(out, prefix="rank")
    assert diag.culprit_ranks == [1, 2], diag.why


SIM_CASES = {
    "p2p_skip_then_compute": ({1: "skip:fwd_send", 14: "hang:bwd_tp"}, [1]),  # 14 never got there
    "skip_tp_and_skip_dp": ({3: "skip:bwd_tp", 12: "skip:dp"}, [3, 12]),
    "skip_loss_send_on_default_group": ({12: "skip:loss_p2p", 0: "hang:loss_p2p"}, [0, 12]),
    "a2a_skip_in_a_pipeline_cycle": ({2: "skip:fwd_a2a"}, [2]),
    "two_compute_hangs": ({5: "hang:fwd_a2a", 10: "hang:start"}, [5, 10]),
}


@pytest.mark.parametrize("case", SIM_CASES)
def test_nccl_dumps_of_a_megatron_job_name_each_fault_that_happened(tmp_path, case):
    faults, culprits = SIM_CASES[case]
    assert sorted(fr_sim.reached(faults, fr_sim.play(faults))) == culprits  # the scheduler's truth
    diag = diagnose_dumps(fr_sim.write_case(tmp_path, faults))
    assert diag.culprit_ranks == culprits, diag.why


def test_p2p_is_paired_per_sender_and_receiver_not_by_the_groups_number(tmp_path):
    # rank 1 skipped a send to rank 5: on the 4-rank pipeline group every rank's p2p number
    # differs, so comparing them named the whole group; pairing the send with its receive does not
    diag = diagnose_dumps(fr_sim.write_case(tmp_path, {1: "skip:fwd_send"}))
    assert diag.culprit_ranks == [1], diag.why
    assert "rank 5 waits in recv from rank 1 on group" in diag.why, diag.why
    assert "rank 1 never posted the matching send" in diag.why


def test_a_missing_dump_of_the_root_is_named_from_its_peers(tmp_path):
    diag = diagnose_dumps(fr_sim.write_case(tmp_path, {6: "hang:fwd_a2a"}, drop=(6,)))
    assert diag.culprit_ranks == [6] and diag.evidence["ranks_without_dump"] == [6], diag.why


def test_a_sweep_of_two_fault_jobs_never_names_a_healthy_rank(tmp_path):
    """60 jobs, two random faults each (a compute hang before any op, or a skipped op):
    no healthy rank is ever named, and the faults that happened are found (≥ 95 %)."""
    rng = random.Random(7)
    found = total = 0
    for n in range(60):
        faults = {}
        for rank in rng.sample(range(fr_sim.WORLD), 2):
            kind = rng.choice(["hang", "skip"])
            labels = [op.label for op in fr_sim.program(rank, fr_sim.FAULT_STEP)]
            faults[rank] = f"{kind}:{rng.choice(labels + (['start'] if kind == 'hang' else []))}"
        truth = fr_sim.reached(faults, fr_sim.play(faults))
        diag = diagnose_dumps(fr_sim.write_case(tmp_path / str(n), faults))
        assert set(diag.culprit_ranks) <= truth, (faults, diag.why)
        found += len(truth & set(diag.culprit_ranks))
        total += len(truth)
    assert found >= 0.95 * total, (found, total)


def _loop(sites: list[str], skip_at: int | None = None, steps: int = 4) -> dict[int, str]:
    """Collective number -> call site of a rank that runs `sites` every step, skipping number
    `skip_at` of the whole sequence once."""
    calls = [s for _ in range(steps) for s in sites]
    if skip_at is not None:
        del calls[skip_at]
    return dict(enumerate(calls))


def test_a_skip_in_a_loop_of_two_alternating_sites_is_told_by_what_follows():
    """An all-to-all out and back (dispatch, combine) in two layers, then the backward's own
    sites: at the skip, a shift either way fits the first numbers; only the later ones tell."""
    step = ["dispatch", "combine", "dispatch", "combine", "back", "back", "back", "back"]
    skipper = _loop(step, skip_at=8)
    for sites in ({0: _loop(step), 1: skipper}, {0: skipper, 1: _loop(step)}):
        seq, ahead, rest = signatures._shifted_in(sites)
        assert seq == 8 and ahead == [next(r for r in sites if sites[r] is skipper)]


def test_a_shift_that_nothing_after_it_tells_apart_is_no_verdict():
    """The records end before the later numbers tell which rank is one ahead: naming either is
    a guess. The same records kept longer name the skipper."""
    step = ["loss", "dispatch", "combine", "dispatch", "combine"]
    normal, skipper = _loop(step), _loop(step, skip_at=6)

    def cut(sites: dict[int, str], n: int) -> dict[int, str]:
        return {k: v for k, v in sites.items() if k < n}

    assert signatures._shifted_in({0: cut(normal, 9), 1: cut(skipper, 9)}) is None
    assert signatures._shifted_in({0: normal, 1: skipper}) == (6, [1], [0])


def test_a_tie_is_broken_by_the_rank_that_left_its_own_habit():
    """Both crashed on the pairing (no later records): the rank whose #s came from another
    site than at the same place of its previous step is the one that skipped."""
    step = ["loss", "dispatch", "combine", "dispatch", "combine"]
    normal, skipper = _loop(step), _loop(step, skip_at=6)
    cut = {0: {k: v for k, v in normal.items() if k < 7}, 1: {k: v for k, v in skipper.items() if k < 7}}
    assert signatures._shifted_in(cut) is None
    assert signatures._shifted_in(cut, lambda seq: {1}) == (6, [1], [0])
    assert signatures._shifted_in(cut, lambda seq: {0, 1}) is None  # both changed: no verdict
