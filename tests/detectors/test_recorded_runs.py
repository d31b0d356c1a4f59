"""Replay the recorded runs of fixtures/stores: every injected fault found with its type and
rank, and nothing raised on the clean runs (a regression guard on detection quality)."""

import pytest

from fixtures.recorded import ANOMALIES as EXPECTED
from fixtures.recorded import (
    DETECTION,
    HELD_OUT,
    NOISE_BEFORE_FAULT,
    PERSISTENT,
    PHASE_STRAGGLERS,
    PHASES,
)
from fixtures.recorded import STORES as DATA
from fixtures.recorded import replay as ours
from meshscope.collector.store import load_events, load_steps

ALL = [*DETECTION, *HELD_OUT]


@pytest.mark.parametrize("name", [n for n in ALL if n.startswith("clean")])
def test_clean_runs_raise_nothing(name):
    assert ours(DATA / name) == []


@pytest.mark.parametrize("name", [n for n in ALL if not n.startswith("clean")])
def test_each_injected_fault_is_found(name):
    kind = name.removesuffix("-2")
    inj = load_events(DATA / name, kind="injected")["detail"].iloc[0]
    found = [
        e
        for e in ours(DATA / name)
        if e.type in EXPECTED[kind]
        and e.start_step <= inj["start_step"] + inj["steps"] + 5
        and e.end_step >= inj["start_step"]
    ]
    assert found, name
    assert found[0].start_step - inj["start_step"] <= 5
    if found[0].ranks and kind in ("slow", "nan", "memory_leak"):
        assert found[0].ranks == [inj["rank"]]


def test_a_persistent_1_4x_straggler_on_a_noisy_4_rank_run_is_named():
    """Recorded: 4 CPU ranks on 2 cores (bursts of 50 % for several steps in clean runs),
    rank 2 slowed 1.4x from step 100 for good (its peers speed up as it sleeps, so either
    horizon may name it first); the clean twin raises nothing."""
    slow = ours(PERSISTENT / "slow4")
    assert [(e.type, e.ranks) for e in slow] == [("straggler", [2])]
    assert 100 <= slow[0].start_step <= 115
    assert ours(PERSISTENT / "clean4") == []


def test_a_busy_hosts_slow_step_right_before_a_straggler_is_not_its_start():
    """Recorded in CI on a busy machine: rank 1 slowed 3x from step 40, and its step 39 took
    1.9x by chance. The episode starts at the fault, with the fault's evidence."""
    inj = load_events(NOISE_BEFORE_FAULT, kind="injected")["detail"].iloc[0]
    found = [(e.type, e.ranks, e.start_step) for e in ours(NOISE_BEFORE_FAULT)]
    assert found == [("straggler", [inj["rank"]], inj["start_step"])]


@pytest.mark.parametrize("name", sorted(PHASE_STRAGGLERS))
def test_several_stragglers_at_1_3x_on_a_shared_host_are_named_from_their_phases(name):
    """Recorded: 4 ranks on 2 cores, one, two or three of them 1.3x slow (the slow ranks'
    forward triples, their peers wait in communication, and the job's median is the slow
    half with three). Each slow rank is named, no other, within 15 steps of the start; the
    episodes end within 15 steps of the fault's end (the phase statistics span 12 steps); clean
    runs raise nothing. Judged against the host, as `meshscope detect --run` does."""
    slow, first, last = PHASE_STRAGGLERS[name]
    found = [e for e in ours(PHASES / name, on_its_host=True) if e.type == "straggler"]
    assert sorted(r for e in found for r in e.ranks) == sorted(slow), [(e.ranks, e.start_step) for e in found]
    for episode in found:
        assert first <= episode.start_step <= first + 15, (episode.ranks, episode.start_step)
        assert episode.end_step <= last + 15, (episode.ranks, episode.end_step)


def test_sensitivity_reaches_the_pace_rule():
    """`detect.sensitivity` scales every line, the own-pace rule's too: at a tenth, the three
    1.3x ranks (named at the default: their forward triples) are within what the lines allow."""
    name = "three-1.3-b"
    assert [e for e in ours(PHASES / name, on_its_host=True) if e.type == "straggler"]
    quiet = ours(PHASES / name, on_its_host=True, sensitivity=0.1)
    assert [e for e in quiet if e.type == "straggler"] == [], [(e.ranks, e.start_step) for e in quiet]


def test_an_expert_collapse_is_told_as_its_phases_each_ending_with_it():
    """Recorded: layer 1's router sends every token to expert 0 for 15 steps; afterwards the
    router has learnt to avoid it and it starves for the rest of the run. Two episodes of
    expert 0: the hog, ending within 5 steps of the fault's end, then the starving, which is
    reported once and then becomes the layer's normal (it says at which share)."""
    run = DATA / "expert_collapse-2"
    inj = load_events(run, kind="injected")["detail"].iloc[0]
    last = inj["start_step"] + inj["steps"] - 1
    mine = sorted(
        (e for e in ours(run) if e.type == "expert_imbalance" and e.expert == 0), key=lambda e: e.start_step
    )
    assert [e.evidence["kind"] for e in mine] == ["hog", "starve"], [(e.evidence, e.start_step) for e in mine]
    hog, starve = mine
    assert inj["start_step"] <= hog.start_step <= inj["start_step"] + 5 and abs(hog.end_step - last) <= 5
    assert starve.start_step > hog.end_step and starve.evidence["new_normal"] == 0.0
    assert starve.end_step < int(load_steps(run)["step"].max())  # settled: no longer flagged
