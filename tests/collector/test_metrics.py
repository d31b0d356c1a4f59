import subprocess

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from meshscope.collector.metrics import DetectorMetrics, MeshscopeMetrics
from meshscope.collector.schema import StepRecord
from tests.conftest import require_binary


def record(**kw):
    base = dict(
        run_id="r",
        rank=0,
        world_size=2,
        step=0,
        time=0.0,
        step_s=0.2,
        forward_s=0.05,
        backward_s=0.1,
        optimizer_s=0.03,
        comm_total_s=0.08,
        comm_exposed_s=0.02,
        comm_ratio=0.1,
        bytes_raw=4000,
        bytes_wire=125,
        loss=2.5,
        grad_norm=1.5,
        tokens=256,
        mem_rss=1 << 20,
    )
    base.update(kw)
    return StepRecord(**base)


def test_observe_step_updates_every_family():
    reg = CollectorRegistry()
    m = MeshscopeMetrics(reg)
    m.observe_step(record())
    m.observe_step(record(step=1, loss=2.0))
    get = reg.get_sample_value
    assert get("meshscope_steps_total") == 2
    assert get("meshscope_tokens_total") == 512
    assert get("meshscope_step_duration_seconds_count") == 2
    assert get("meshscope_step_phase_seconds", {"phase": "backward"}) == 0.1
    assert get("meshscope_comm_bytes_total", {"kind": "wire"}) == 250
    assert get("meshscope_comm_seconds_total", {"kind": "exposed"}) == pytest.approx(0.04)
    assert get("meshscope_loss") == 2.0
    assert get("meshscope_memory_bytes", {"kind": "rss"}) == 1 << 20


def test_expert_load_ratio_and_imbalance():
    reg = CollectorRegistry()
    m = MeshscopeMetrics(reg)
    m.observe_experts([[[30, 10, 0, 0], [10, 10, 10, 10]]])
    get = reg.get_sample_value
    assert get("meshscope_expert_load_ratio", {"layer": "0", "expert": "0"}) == 3.0
    assert get("meshscope_expert_imbalance_ratio", {"layer": "0"}) == 3.0
    assert get("meshscope_expert_imbalance_ratio", {"layer": "1"}) == 1.0
    assert get("meshscope_expert_tokens_total", {"layer": "0", "expert": "1"}) == 10


def test_a_batch_of_expert_windows_counts_them_all_and_gauges_the_latest():
    reg = CollectorRegistry()
    m = MeshscopeMetrics(reg)
    m.observe_experts([[[30, 10], [5, 5]], [[10, 10], [0, 20]]])
    get = reg.get_sample_value
    assert get("meshscope_expert_tokens_total", {"layer": "0", "expert": "0"}) == 40
    assert get("meshscope_expert_tokens_total", {"layer": "1", "expert": "1"}) == 25
    assert get("meshscope_expert_load_ratio", {"layer": "0", "expert": "0"}) == 1.0  # the latest
    assert get("meshscope_expert_imbalance_ratio", {"layer": "1"}) == 2.0


def test_no_topology_labels_on_metrics():
    reg = CollectorRegistry()
    MeshscopeMetrics(reg).observe_step(record())
    text = generate_latest(reg).decode()
    assert 'rank="' not in text and 'run="' not in text and 'node="' not in text


def test_promtool_check_metrics_is_clean():
    promtool = require_binary("promtool")
    reg = CollectorRegistry()
    m = MeshscopeMetrics(reg)
    m.describe_run(device="cpu", backend="gloo", world_size=2, compression="onebit", version="0")
    m.observe_step(record())
    m.observe_experts([[[3, 1], [2, 2]]])
    m.heartbeat_age.labels(peer="1").set(0.5)
    detector_reg = CollectorRegistry()  # the detector's own endpoint (job meshscope_detector)
    d = DetectorMetrics(detector_reg)
    d.anomaly_score.labels(detector="isolation_forest").set(0.1)
    d.faults.labels(kind="hang").inc()
    for registry in (reg, detector_reg):
        out = subprocess.run(
            [promtool, "check", "metrics"], input=generate_latest(registry), capture_output=True, timeout=30
        )
        assert out.returncode == 0 and out.stdout + out.stderr == b"", out.stdout + out.stderr


def test_expert_windows_of_a_larger_model_grow_the_table_and_keep_what_was_counted():
    reg = CollectorRegistry()
    m = MeshscopeMetrics(reg)
    m.observe_experts([[[4, 4]]])
    m.observe_experts([[[1, 1, 2]], [[2, 2, 0], [6, 2, 0]]])
    get = reg.get_sample_value
    assert get("meshscope_expert_tokens_total", {"layer": "0", "expert": "0"}) == 7
    assert get("meshscope_expert_tokens_total", {"layer": "0", "expert": "2"}) == 2
    assert get("meshscope_expert_tokens_total", {"layer": "1", "expert": "0"}) == 6
    assert get("meshscope_expert_imbalance_ratio", {"layer": "1"}) == 2.25  # the latest window's
    assert get("meshscope_expert_load_ratio", {"layer": "0", "expert": "2"}) == 0.0


def test_a_batch_of_expert_windows_updates_no_series_until_a_scrape(monkeypatch):
    """The service thread's batch is array sums, whatever the model's size (as labelled series
    it updated two a (layer, expert): 5.6 ms a batch at 48 layers x 64 experts); the scrape
    makes the series."""
    from prometheus_client import values

    reg = CollectorRegistry()
    m = MeshscopeMetrics(reg)
    updates = []
    for name in ("inc", "set"):
        real = getattr(values.ValueClass, name)
        counted = lambda self, v, real=real: updates.append(v) or real(self, v)  # noqa: E731
        monkeypatch.setattr(values.ValueClass, name, counted)
    m.observe_experts([[[1.0] * 64] * 48] * 3)
    assert updates == []
    assert reg.get_sample_value("meshscope_expert_tokens_total", {"layer": "47", "expert": "63"}) == 3
