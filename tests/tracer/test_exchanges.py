"""Placing a NaN under expert parallelism from what a holder's experts took in and gave out at
their exchanges (`tracer.exchanges`): the holder is named, a NaN that arrived from elsewhere
names nobody, and the rows of an uneven (dropless) exchange map to the right expert."""

from __future__ import annotations

import math

import pytest
import torch

from fixtures.dist import run_ranks
from meshscope.collector.moe import ExchangeSide
from meshscope.tracer.exchanges import made_here

EXPERTS = torch.nn.Linear(1, 1)  # stands for a layer's experts: only its identity matters
RUNS = ((0, 2), (1, 1), (0, 1), (1, 3))  # (local expert, rows) as two senders' pieces arrive


def _step(forward_out: list[float], backward_in: float, backward_out: list[float]) -> tuple[list, list]:
    """One layer's four exchanges in execution order, and their sums."""
    sides = [
        ExchangeSide(EXPERTS, "forward", True),
        ExchangeSide(EXPERTS, "forward", False, RUNS),
        ExchangeSide(EXPERTS, "backward", True),
        ExchangeSide(EXPERTS, "backward", False, RUNS),
    ]
    return sides, [1.0, *forward_out, backward_in, *backward_out]


CLEAN = [1.0] * 7


def test_rows_a_holders_experts_made_non_finite_from_finite_input_name_those_experts():
    bad_in_expert_1 = [1.0, 1.0, 1.0, 1.0, math.nan, 1.0, 1.0]  # a row of the last piece: expert 1
    assert made_here(*_step(CLEAN, 1.0, bad_in_expert_1)) == (EXPERTS, "backward", [1])
    forward_bad = [math.inf, 2.0, 1.0, math.nan, 1.0, 1.0, 1.0]  # expert 0's rows
    assert made_here(*_step(forward_bad, 1.0, bad_in_expert_1)) == (EXPERTS, "forward", [0])


def test_a_nan_that_arrived_non_finite_or_a_clean_step_names_nobody():
    arrived_bad = [math.nan] * 7  # the gradient reaching the experts was already NaN: made elsewhere
    assert made_here(*_step(CLEAN, math.nan, arrived_bad)) is None
    assert made_here(*_step(CLEAN, 1.0, CLEAN)) is None
    sides, sums = _step(CLEAN, 1.0, [math.nan] * 7)
    assert made_here(sides, sums) == (EXPERTS, "backward", [0, 1])
    assert made_here(sides[1:2] + sides[3:], sums[1:8] + sums[9:]) is None  # nothing seen arrive


def _dropless_step(
    rank: int, world_size: int, run_dir: str, poisoned: int, watch: bool = True, at: tuple[int, ...] = (1,)
) -> list[dict]:
    """Three dropless expert-parallel steps of the reference trainer with the tracer on; at
    the steps `at` a NaN is made inside backward of rank 0's local expert `poisoned` (its output's
    gradient, past the exchange that brought it): each rank's findings."""
    from meshscope.tracer.trace import TensorTracer, TracerConfig
    from meshscope.trainer.inject import Injector
    from meshscope.trainer.loop import train_step
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
    injector = Injector([], rank, lambda inj, step: None)
    for _ in range(3):
        train_step(state, mon, cfg, dev, injector)
    state.tracer.close()
    mon.close()
    return found


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
