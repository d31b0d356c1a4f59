"""Compression hooks on 2 real gloo ranks: agreement with all-reduce, bytes, error feedback."""

import types

import pytest
import torch

from fixtures.dist import run_ranks
from meshscope.collector.comm import allreduce_sent_bytes
from meshscope.trainer.comm import build_hook, fp16_wire_bytes, powersgd_wire_bytes
from meshscope.trainer.onebit import compress, decompress, onebit_wire_bytes, pack_signs, unpack_signs
from tests.trainer import dist_cases


@pytest.fixture(scope="module")
def agreement(tmp_path_factory):
    return run_ranks(dist_cases.hook_agreement, 2, run_dir=str(tmp_path_factory.mktemp("hooks")))


def test_fp16_and_powersgd_agree_with_allreduce_each_step(agreement):
    for rank_result in agreement:
        assert rank_result["none"]["last_error"] < 1e-6
        assert rank_result["fp16"]["last_error"] < 2e-3
        # rank-2 gradients, rank-2 PowerSGD: exact up to float error once compressing
        assert rank_result["powersgd"]["last_error"] < 1e-3


def test_onebit_with_error_feedback_converges_in_time_average(agreement):
    onebit = agreement[0]["onebit"]
    assert onebit["mean_error"] < 0.5
    # error feedback: the time-averaged gradient keeps closing in on the exact mean
    assert onebit["mean_error"] < 0.8 * onebit["mean_error_early"]


def test_wire_over_raw_matches_each_format(agreement):
    r = agreement[0]
    ratio = {k: v["bytes_wire"][-1] / v["bytes_raw"][-1] for k, v in r.items()}
    assert ratio["none"] == pytest.approx(1.0)  # 2(W-1)/W at W=2
    assert ratio["fp16"] == pytest.approx(0.5)
    assert 0.15 < ratio["powersgd"] < 0.5  # only the 16x32 weight is worth compressing
    assert 1 / 32 < ratio["onebit"] < 1 / 16  # 1/32 of signs, 1/256 of scales, and padding
    assert r["powersgd"]["bytes_wire"][0] == r["powersgd"]["bytes_raw"][0]  # warm-up: plain
    # time in flight on sampled steps: one in 10 by the hook's marks...
    total = r["onebit"]["comm_total_s"]
    assert all(t > 0 for step, t in enumerate(total) if step % 10 == 0)
    assert all(t != t for step, t in enumerate(total) if step % 10)  # NaN: not measured
    # ...or DDP's own timer (its C++ all-reduce, no Python hook), read around sampled steps
    measured = [t for t in r["none"]["comm_total_s"] if t == t]
    assert len(measured) >= 48 // 10 and all(t > 0 for t in measured)
    for name in ("none", "onebit"):
        exposed = r[name]["comm_exposed_s"]  # the wait after backward: every step
        assert all(e >= 0 for e in exposed) and sum(e > 0 for e in exposed) > len(exposed) / 2


def test_onebit_error_feedback_reaches_the_convex_optimum():
    result = run_ranks(dist_cases.convex_problem, 2)[0]
    assert abs(result["onebit_ef"] - result["sgd"]) / result["sgd"] <= 0.02
    assert result["onebit_no_ef"] > 1.5 * result["sgd"]  # measurably worse without it


def test_padding_neither_dilutes_scales_nor_decodes():
    x = torch.cat([torch.full((4,), 3.0), torch.zeros(12)])
    _, scales, decoded = compress(x, block=8, valid=4)
    assert scales.tolist() == [3.0, 0.0]
    assert decoded.tolist() == [3.0] * 4 + [0.0] * 12


def test_sign_packing_round_trip():
    x = torch.randn(64)
    assert torch.equal(unpack_signs(pack_signs(x)), torch.where(x >= 0, 1.0, -1.0))
    assert pack_signs(x).numel() == 8


def test_compress_keeps_per_block_mean_magnitude():
    x = torch.cat([torch.full((8,), 2.0), torch.full((8,), -0.5)])
    packed, scales, decoded = compress(x, block=8)
    assert scales.tolist() == [2.0, 0.5]
    assert torch.equal(decompress(packed, scales), decoded)
    assert torch.equal(decoded, x)


def _bucket(*shapes):
    grads = [torch.zeros(s) for s in shapes]
    flat = torch.zeros(sum(g.numel() for g in grads))
    return types.SimpleNamespace(buffer=lambda: flat, gradients=lambda: grads)


def test_onebit_sends_at_most_a_sixteenth_of_allreduce_at_four_ranks():
    bucket = _bucket((1024, 1024))
    raw = allreduce_sent_bytes(1024 * 1024 * 4, 4)
    assert onebit_wire_bytes(None, bucket, 4) <= raw / 16
    assert fp16_wire_bytes(None, bucket, 4) == raw // 2


def test_powersgd_byte_count_follows_torchs_rules():
    spec = build_hook("powersgd", powersgd_rank=4)
    bucket = _bucket((256, 128), (256,), (4, 4))
    spec.state.iter = 0
    assert powersgd_wire_bytes(spec.state, bucket, 2) == bucket.buffer().numel() * 4
    spec.state.iter = 10
    expected = ((256 + 128) * 4 + 256 + 16) * 4  # P+Q of the matrix; vector and 4x4 uncompressed
    assert powersgd_wire_bytes(spec.state, bucket, 2) == expected


def test_onebit_memories_are_per_parameter_so_buckets_and_restarts_change_nothing(tmp_path):
    """DDP runs a process's first iteration on one bucket and re-buckets after it: the 1-bit
    hook keeps its memories per parameter, so one bucket or a bucket per layer, and a restart
    in a new DDP from the saved state, end in the same weights and memories, bit for bit."""
    for result in run_ranks(dist_cases.onebit_across_buckets, 2):
        reference_weights, reference_memories = result["one bucket"]
        assert set(reference_memories) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        for way in ("bucket per layer", "restarted"):
            weights, memories = result[way]
            assert all(torch.equal(a, b) for a, b in zip(weights, reference_weights)), way
            for name, (worker, server) in reference_memories.items():
                assert torch.equal(memories[name][0], worker) and torch.equal(memories[name][1], server), (
                    way,
                    name,
                )
        assert any(w.abs().sum() > 0 for w, _ in reference_memories.values())  # memories were kept
