"""Placing a NaN under expert parallelism from what a holder's experts took in and gave out at
their exchanges (`tracer.exchanges`): the holder is named, a NaN that arrived from elsewhere
names nobody, and the rows of an uneven (dropless) exchange map to the right expert."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from fixtures.dist import run_ranks
from meshscope.collector.moe import ExchangeSide
from meshscope.tracer.exchanges import RECEIVED, SENT, Made, made_here

EXPERTS = torch.nn.Linear(1, 1)  # stands for a layer's experts: only its identity matters
RUNS = ((0, 2), (1, 1), (0, 1), (1, 3))  # (local expert, rows) as two senders' pieces arrive
FINE = 1.0


def _step(
    forward_out: list[float],
    backward_in: float,
    backward_out: list[float],
    own_sent: tuple[float, float] = (FINE, FINE),
    came_back: tuple[float, float] = (FINE, FINE),
) -> tuple[list, list]:
    """One layer's four exchanges in execution order, each as its two halves (what is sent,
    then what arrived), and their sums. `own_sent`: what this rank's own layers sent (forward,
    backward); `came_back`: what came back to them (forward, backward)."""
    marks = [
        (ExchangeSide(EXPERTS, "forward", True), SENT),  # dispatch: this rank's tokens go out
        (ExchangeSide(EXPERTS, "forward", True), RECEIVED),  # and feed its experts
        (ExchangeSide(EXPERTS, "forward", False, RUNS), SENT),  # combine: the experts' rows leave
        (ExchangeSide(EXPERTS, "forward", False, RUNS), RECEIVED),  # and results come back
        (ExchangeSide(EXPERTS, "backward", True), SENT),
        (ExchangeSide(EXPERTS, "backward", True), RECEIVED),
        (ExchangeSide(EXPERTS, "backward", False, RUNS), SENT),
        (ExchangeSide(EXPERTS, "backward", False, RUNS), RECEIVED),
    ]
    sums = [
        own_sent[0],
        FINE,
        *forward_out,
        came_back[0],
        own_sent[1],
        backward_in,
        *backward_out,
        came_back[1],
    ]
    return marks, sums


CLEAN = [FINE] * 7


def test_rows_a_holders_experts_made_non_finite_from_finite_input_name_those_experts():
    bad_in_expert_1 = [1.0, 1.0, 1.0, 1.0, math.nan, 1.0, 1.0]  # a row of the last piece: expert 1
    assert made_here(*_step(CLEAN, 1.0, bad_in_expert_1), True) == Made(EXPERTS, "backward", [1])
    forward_bad = [math.inf, 2.0, 1.0, math.nan, 1.0, 1.0, 1.0]  # expert 0's rows
    assert made_here(*_step(forward_bad, 1.0, bad_in_expert_1), True) == Made(EXPERTS, "forward", [0])


def test_a_nan_that_arrived_non_finite_or_a_clean_step_names_nobody():
    arrived_bad = [math.nan] * 7  # the gradient reaching the experts was already NaN: made elsewhere
    assert made_here(*_step(CLEAN, math.nan, arrived_bad), True) is None
    assert made_here(*_step(CLEAN, 1.0, CLEAN), True) is None
    marks, sums = _step(CLEAN, 1.0, [math.nan] * 7)
    assert made_here(marks, sums, True) == Made(EXPERTS, "backward", [0, 1])
    kept = [i for i, (side, half) in enumerate(marks) if not (side.feeds and half == RECEIVED)]
    values = _flat(marks, sums)  # without what fed the experts: nothing seen arrive
    assert made_here([marks[i] for i in kept], [v for i in kept for v in values[i]], True) is None


def _flat(marks: list, sums: list[float]) -> list:
    """Each mark's values, as one list per mark (rows of what left the experts, else one)."""
    out, at = [], 0
    for side, half in marks:
        count = side.rows() if half == SENT and not side.feeds else 1
        out.append(sums[at : at + count])
        at += count
    return out


def test_what_this_ranks_own_layers_sent_non_finite_names_the_layer_that_carried_it():
    """Its own layers computed from what came back (finite) and sent a NaN: this rank made it,
    forward or backward, before any expert of its own made one later."""
    assert made_here(*_step(CLEAN, 1.0, CLEAN, own_sent=(math.nan, FINE)), True) == Made(
        EXPERTS, "forward", None
    )
    assert made_here(*_step(CLEAN, 1.0, CLEAN, own_sent=(FINE, math.inf)), True) == Made(
        EXPERTS, "backward", None
    )
    # its own layers sent it before its experts' rows left non-finite: the first is the verdict
    later = [math.nan] * 7
    assert made_here(*_step(later, 1.0, CLEAN, own_sent=(math.nan, FINE)), True) == Made(
        EXPERTS, "forward", None
    )


def test_a_nan_this_ranks_backward_sent_names_nobody_when_its_loss_was_not_finite():
    """Its own loss already non-finite (a NaN made after its last expert layer, in forward):
    the NaN its backward sends began in forward, not in backward: no place from here."""
    own_backward_bad = _step(CLEAN, 1.0, CLEAN, own_sent=(FINE, math.nan))
    assert made_here(*own_backward_bad, False) is None
    assert made_here(*_step(CLEAN, 1.0, CLEAN, own_sent=(math.nan, FINE)), False) == Made(
        EXPERTS, "forward", None
    )


def test_a_nan_that_came_back_from_a_peer_names_nobody_here():
    """What came back to this rank's own layers was already non-finite: what they send next
    is not theirs to answer for."""
    came_back_bad = _step(CLEAN, 1.0, CLEAN, own_sent=(FINE, math.nan), came_back=(math.nan, FINE))
    assert made_here(*came_back_bad, True) is None


def _dropless_step(
    rank: int, world_size: int, run_dir: str, poisoned: int, watch: bool = True, at: tuple[int, ...] = (1,)
) -> list[dict]:
    """Three dropless expert-parallel steps of the reference trainer with the tracer on; at
    the steps `at` a NaN is made inside backward of rank 0's local expert `poisoned` (its output's
    gradient, past the exchange that brought it): each rank's findings."""
    from meshscope.tracer.trace import TensorTracer, TracerConfig
    from tests.trainer.test_experts import _trainer

    cfg, dev, mon, state, _ = _trainer(rank, world_size, 2, run_dir, "cpu", dispatch="dropless")
    found: list[dict] = []
    config = TracerConfig(exchanges=watch)
    state.tracer = TensorTracer(
        state.model, config, rank=rank, report=lambda kind, step, d: found.append({**d, "step": step})
    )
    experts = state.model.blocks[0].moe.experts
    one = experts.one

    def poisoned_one(index: int, x: torch.Tensor) -> torch.Tensor:
        y = one(index, x)
        if rank == 0 and index == poisoned and state.step in at and y.requires_grad:
            y.register_hook(lambda g: g * math.nan)
        return y

    experts.one = poisoned_one
    return _three_steps(rank, cfg, dev, mon, state, found)


@pytest.mark.parametrize("poisoned", [0, 1])
def test_a_dropless_holder_names_the_expert_whose_backward_made_the_nan(tmp_path, poisoned):
    """Rank 0 holds experts 0 and 1: the one whose backward made the NaN is named by rank 0
    alone; rank 1 reports the non-finite step without a place."""
    ranks = run_ranks(_dropless_step, world_size=2, run_dir=str(tmp_path), poisoned=poisoned)
    placed = [
        (r, f["step"], f["module"], f["experts"], f["where"]) for r, found in enumerate(ranks) for f in found
    ]
    assert placed == [(0, 1, "blocks.0.moe.experts", [poisoned], "backward"), (1, 1, "", [], "forward")], (
        ranks
    )


def test_with_the_exchanges_unwatched_the_holder_cannot_place_it(tmp_path):
    """`tracer.exchanges = false`: nothing read at the exchanges, so no rank places the NaN."""
    ranks = run_ranks(_dropless_step, world_size=2, run_dir=str(tmp_path), poisoned=1, watch=False)
    assert [[f["module"] for f in found] for found in ranks] == [[""], [""]], ranks


def test_the_same_expert_made_again_is_placed_once(tmp_path):
    """A NaN made in the same expert at steps 1 and 2 is one finding (`repeat_after`), not one
    a step; the peer reports each non-finite step unplaced."""
    ranks = run_ranks(_dropless_step, world_size=2, run_dir=str(tmp_path), poisoned=1, at=(1, 2))
    placed = [(r, f["step"], f["module"]) for r, found in enumerate(ranks) for f in found]
    assert placed == [(0, 1, "blocks.0.moe.experts"), (1, 1, ""), (1, 2, "")], ranks


def _overflow_step(
    rank: int, world_size: int, run_dir: str, dispatch: str, module: str = "blocks.1.attn"
) -> list[dict]:
    """Three expert-parallel steps; at step 1 rank 0's `module` gives an Inf output from
    finite weights (an overflow): each rank's findings."""
    from meshscope.tracer.trace import TensorTracer, TracerConfig
    from tests.trainer.test_experts import _trainer

    cfg, dev, mon, state, _ = _trainer(rank, world_size, 2, run_dir, "cpu", dispatch=dispatch)
    found: list[dict] = []
    state.tracer = TensorTracer(
        state.model, TracerConfig(), rank=rank, report=lambda kind, step, d: found.append({**d, "step": step})
    )

    def overflow(hooked: torch.nn.Module, args: Any, output: Any) -> Any:
        if rank == 0 and state.step == 1:
            return (output[0] * math.inf, *output[1:]) if isinstance(output, tuple) else output * math.inf
        return output

    state.model.get_submodule(module).register_forward_hook(overflow)
    return _three_steps(rank, cfg, dev, mon, state, found)


def _three_steps(rank: int, cfg: Any, dev: Any, mon: Any, state: Any, found: list[dict]) -> list[dict]:
    """Three training steps of `state`, then its tracer and Monitor closed: `found`, what its
    tracer reported."""
    from meshscope.trainer.inject import Injector
    from meshscope.trainer.loop import train_step

    injector = Injector([], rank, lambda inj, step: None)
    for _ in range(3):
        train_step(state, mon, cfg, dev, injector)
    state.tracer.close()
    mon.close()
    return found


@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_a_rank_whose_attention_made_a_nan_in_forward_names_the_layer_that_carried_it(tmp_path, dispatch):
    """Rank 0's attention overflows with finite weights: rank 0 alone places it, at the input
    of the next expert layer (`blocks.1.moe`); rank 1 reports its non-finite step unplaced."""
    ranks = run_ranks(_overflow_step, world_size=2, run_dir=str(tmp_path), dispatch=dispatch)
    placed = [
        (r, f["step"], f["module"], f["where"], f["tensor"]) for r, found in enumerate(ranks) for f in found
    ]
    assert placed[0] == (0, 1, "blocks.1.moe", "forward", "input"), ranks
    assert all(module == "" for r, _, module, _, _ in placed[1:] if r == 1), ranks


def test_a_nan_made_after_the_last_expert_layer_in_forward_is_not_placed_in_backward(tmp_path):
    """Rank 0's final norm overflows: nothing it sent in forward was non-finite, and its
    backward then sends NaN from a non-finite loss. That began in forward, so no rank places
    it at an exchange (before, rank 0 named `blocks.1.moe` in backward: the wrong phase)."""
    ranks = run_ranks(_overflow_step, world_size=2, run_dir=str(tmp_path), dispatch="dropless", module="ln_f")
    told = [(r, f["step"], f["module"]) for r, found in enumerate(ranks) for f in found]
    assert told == [(0, 1, ""), (1, 1, "")], ranks
