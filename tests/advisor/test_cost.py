"""The cost model's formulas, each against the number it must give, and the search's rules."""

from __future__ import annotations

import numpy as np
import pytest

from meshscope.advisor.advise import advise
from meshscope.advisor.cost import Factors, params, predict, rank_skew, ring_allreduce, ring_gather
from meshscope.advisor.layouts import Layout, labels, layout_frame
from meshscope.advisor.specs import GIB, AdvisorConfig, ClusterSpec, ModelSpec

DENSE = ModelSpec(layers=8, hidden=1024, heads=16, vocab=32000, seq_len=2048, global_batch=64)
MOE = DENSE.model_copy(update={"experts": 16, "top_k": 2, "moe_ffn_hidden": 1024})


def cluster(nodes: int = 2, per_node: int = 8, memory: float = 80.0) -> ClusterSpec:
    return ClusterSpec(
        nodes=nodes,
        devices_per_node=per_node,
        device={"name": "gpu", "peak_tflops": 100, "memory_gib": memory, "reserved_gib": 0},
        intra={"name": "nvlink", "bandwidth_gbs": 100, "latency_us": 0},
        inter={"name": "ib", "bandwidth_gbs": 10, "latency_us": 0},
    )


def one(layout: Layout, model: ModelSpec = DENSE, hw: ClusterSpec | None = None, **factors):
    return predict(layout_frame([layout], model), model, hw or cluster(), Factors(**factors)).iloc[0]


def test_parameter_count_matches_the_reference_trainers_model():
    torch = pytest.importorskip("torch")
    from meshscope.trainer.config import ModelConfig
    from meshscope.trainer.model import MoELM

    cfg = ModelConfig(
        d_model=64, layers=2, heads=4, experts=8, top_k=2, ffn_mult=2, vocab_size=128, seq_len=32
    )
    torch.manual_seed(0)
    real = sum(p.numel() for p in MoELM(cfg).parameters())
    spec = ModelSpec(
        layers=2, hidden=64, heads=4, ffn_hidden=128, vocab=128, seq_len=32, global_batch=8, experts=8
    )
    p = params(spec)
    assert p["dense"] + p["routed"] == pytest.approx(real, rel=0.03)  # layer norms and positions aside


def test_collectives_follow_the_ring_formulas():
    assert ring_allreduce(1e9, 4, 1e9, 0.0) == pytest.approx(1.5)
    assert ring_gather(1e9, 4, 1e9, 0.0) == pytest.approx(0.75)
    assert ring_allreduce(1e9, 1, 1e9, 1.0) == 0.0
    assert ring_allreduce(0.0, 8, 1e9, 1e-6) == pytest.approx(14e-6)  # 2(n-1) hops of latency


@pytest.mark.parametrize("v", [1, 2])
def test_the_bubble_is_p_minus_1_over_v_micro_batch_times(v):
    row = one(Layout(pp=4, dp=4, mb=2, v=v))  # m = 64 / (4 * 2) = 8 micro-batches
    staged = row.compute_s + row.a2a_s  # no TP or CP: the stage's work is compute (+ all-to-all)
    assert row.m == 8
    assert row.bubble_s == pytest.approx(3 / v * staged / 8)


def test_state_memory_is_18_bytes_a_parameter_and_6_plus_12_over_d_with_a_distributed_optimizer():
    plain, dist = one(Layout(dp=16, mb=1)), one(Layout(dp=16, mb=1, dist_opt=True))
    p = params(DENSE)
    assert (plain.memory_gib - dist.memory_gib) * GIB == pytest.approx(p["dense"] * (18 - (6 + 12 / 16)))


def test_activations_follow_korthikanti_and_divide_by_tp_with_sequence_parallelism():
    s, h, a, layers = DENSE.seq_len, DENSE.hidden, DENSE.heads, DENSE.layers
    per_seq = s * h * (34 + 5 * a * s / h) * layers  # one more sequence per micro-batch
    one_more = (one(Layout(dp=16, mb=2)).memory_gib - one(Layout(dp=16, mb=1)).memory_gib) * GIB
    logits = s * DENSE.vocab * 4
    assert one_more == pytest.approx(per_seq + logits, rel=1e-6)
    tp4 = (one(Layout(tp=4, dp=4, mb=2)).memory_gib - one(Layout(tp=4, dp=4, mb=1)).memory_gib) * GIB
    assert tp4 == pytest.approx((per_seq + logits) / 4, rel=1e-6)
    selective = (
        one(Layout(dp=16, mb=2, recompute="selective")).memory_gib
        - one(Layout(dp=16, mb=1, recompute="selective")).memory_gib
    ) * GIB
    assert selective == pytest.approx(s * h * 34 * layers + logits, rel=1e-6)


def test_recompute_costs_flops_and_saves_memory():
    none, sel, full = (one(Layout(dp=16, mb=4, recompute=r)) for r in ("none", "selective", "full"))
    assert none.compute_s < sel.compute_s < full.compute_s
    assert full.compute_s == pytest.approx(none.compute_s * 4 / 3, rel=0.05)
    assert none.memory_gib > sel.memory_gib > full.memory_gib


def test_rank_skew_spreads_the_hottest_expert_over_the_ranks_that_share_it():
    skewed = MOE.model_copy(update={"expert_skew": 3.0})
    assert rank_skew(skewed, np.array([1]))[0] == pytest.approx(1.0)
    assert rank_skew(skewed, np.array([16]))[0] == pytest.approx(3.0)  # one expert per rank
    assert list(np.diff(rank_skew(skewed, np.array([1, 2, 4, 8, 16])))) == sorted(
        np.diff(rank_skew(skewed, np.array([1, 2, 4, 8, 16])))
    )
    balanced, hot = one(Layout(dp=16, ep=8), MOE), one(Layout(dp=16, ep=8), skewed)
    assert hot.a2a_s > balanced.a2a_s and hot.compute_s > balanced.compute_s
    assert hot.a2a_s / balanced.a2a_s == pytest.approx(hot.rank_skew)


def test_groups_that_leave_the_node_pay_the_slower_link():
    inside = one(Layout(tp=8, dp=2, mb=1))  # TP over 8 devices of one node
    hw = cluster(nodes=4, per_node=4)
    across = one(Layout(tp=8, dp=2, mb=1), hw=hw)  # TP over two nodes' devices
    assert across.comm_exposed_s > 5 * inside.comm_exposed_s


def test_every_layout_uses_every_device_and_respects_the_shapes():
    advice = advise(MOE, cluster(), AdvisorConfig(max_comm_ratio=1.0))
    frame = advice.ranked
    assert len(frame) + len(advice.excluded) == advice.evaluated > 100
    assert (frame.tp * frame.pp * frame.cp * frame.dp == 16).all()
    assert (
        (frame.tp <= 8).all() and (MOE.experts % frame.ep == 0).all() and (DENSE.layers % frame.pp == 0).all()
    )
    assert ((frame.dp * frame.cp) % frame.ep == 0).all()
    assert frame.step_s.is_monotonic_increasing


def test_labels_say_what_layout_label_says():
    layouts = [
        Layout(),
        Layout(dp=2, tp=4, ep=2, mb=2, recompute="full", dist_opt=True),
        Layout(pp=2, v=2, cp=2),
    ]
    assert list(labels(layout_frame(layouts, DENSE))) == [lay.label() for lay in layouts]


def test_too_little_memory_is_named_as_the_binding_constraint():
    small = advise(DENSE, cluster(memory=6.0), AdvisorConfig(max_comm_ratio=1.0))
    assert small.binding.startswith("memory"), small.binding
    assert (small.ranked.memory_gib <= 6.0 * 0.9).all()
    assert (small.excluded.memory_gib > 6.0 * 0.9).all()
    roomy = advise(DENSE, cluster(memory=1000.0), AdvisorConfig(max_comm_ratio=1.0))
    assert roomy.binding.startswith("none"), roomy.binding
    assert roomy.best().step_s < small.best().step_s


def test_nothing_fits_says_how_much_the_smallest_layout_needs():
    advice = advise(DENSE, cluster(memory=0.05), AdvisorConfig())
    assert advice.best() is None and advice.binding.startswith("nothing fits")


def test_the_memory_goal_ranks_by_peak_memory():
    advice = advise(DENSE, cluster(), AdvisorConfig(goal="memory", max_comm_ratio=1.0))
    assert advice.ranked.memory_gib.is_monotonic_increasing


def test_a_node_of_device_groups_prices_the_pcie_hop_between_them():
    pcie = {"name": "pcie", "bandwidth_gbs": 25, "latency_us": 0}
    grouped = ClusterSpec.model_validate(cluster().model_dump() | {"devices_per_group": 2, "pcie": pcie})
    pair, node = one(Layout(tp=2, dp=8), hw=grouped), one(Layout(tp=8, dp=2), hw=grouped)
    flat_pair, flat_node = one(Layout(tp=2, dp=8)), one(Layout(tp=8, dp=2))
    assert pair.comm_exposed_s == pytest.approx(flat_pair.comm_exposed_s)  # NVLink inside a pair: as before
    assert node.comm_exposed_s > 3 * flat_node.comm_exposed_s  # 8-way TP crosses PCIe: 4x slower link


def test_groups_that_do_not_divide_the_node_are_refused():
    from meshscope.advisor.specs import SpecError, validate

    data = cluster().model_dump() | {"devices_per_group": 3, "pcie": {"name": "p", "bandwidth_gbs": 1}}
    with pytest.raises(SpecError, match="devices_per_group"):
        validate(ClusterSpec, data, "c.toml")
    with pytest.raises(SpecError, match="pcie"):
        validate(ClusterSpec, cluster().model_dump() | {"devices_per_group": 4}, "c.toml")
