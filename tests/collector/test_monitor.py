import json
import math
import socket

import pytest
import requests
import torch
from prometheus_client import CollectorRegistry

from fixtures.ports import free_port_range
from meshscope.collector import Monitor, MonitorConfig
from meshscope.collector.env import DistEnv
from meshscope.collector.exporter import PortInUseError
from meshscope.collector.store import load_events, load_expert_load, load_expert_work, load_steps


class ToyMoE(torch.nn.Module):
    """A user's own MoE layer: speaks the protocol with one attribute."""

    def __init__(self, counts):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.counts = counts
        self.expert_token_counts = torch.zeros(len(counts))

    def forward(self, x):
        self.expert_token_counts = torch.tensor(self.counts, dtype=torch.float32)
        return self.lin(x)


def make_monitor(tmp_path, **kw):
    cfg = MonitorConfig(run_dir=tmp_path / "run", metrics_port=kw.pop("metrics_port", None), **kw)
    return Monitor(cfg, registry=CollectorRegistry())


def test_step_records_phases_scalars_and_lazy_tensors(tmp_path):
    mon = make_monitor(tmp_path, detail_every=1)
    model = mon.watch(torch.nn.Sequential(ToyMoE([3, 1]), ToyMoE([2, 2])))
    for step in range(4):
        with mon.step(tokens=32) as s:
            with s.phase("forward"):
                out = model(torch.randn(2, 4)).sum()
            with s.phase("backward"):
                out.backward()
            s.log(loss=torch.tensor(1.0 / (step + 1)), grad_norm=0.5)
    mon.close()
    steps = load_steps(tmp_path / "run")
    assert steps["step"].tolist() == [0, 1, 2, 3]
    assert (steps["step_s"] >= steps["forward_s"] + steps["backward_s"]).all()
    assert steps["loss"].tolist() == pytest.approx([1, 0.5, 1 / 3, 0.25])
    assert (steps["tokens"] == 32).all() and (steps["tokens_per_s"] > 0).all()
    assert mon.registry.get_sample_value("meshscope_steps_total") == 4


def test_on_the_host_one_step_in_ten_is_timed_in_full_and_the_others_say_nan_not_zero(tmp_path):
    """A user's loop on the host: phases and the wait for communication on one step in 10;
    every step keeps its time, tokens, loss and bytes, and the others' phases are unknown."""
    from meshscope.collector.monitor_config import HOST_DETAIL_EVERY

    mon = make_monitor(tmp_path)
    seen = []
    model = mon.watch(torch.nn.Linear(4, 4))
    for _ in range(2 * HOST_DETAIL_EVERY + 1):
        with mon.step(tokens=8) as s:
            with s.phase("forward") as timer:
                out = model(torch.randn(2, 4)).sum()
            seen.append(timer)
            with s.phase("backward"):
                out.backward()
            s.log(loss=out)
    mon.close()
    steps = load_steps(tmp_path / "run").set_index("step")
    timed = steps.index % HOST_DETAIL_EVERY == 0
    assert timed.sum() == 3
    assert (steps.loc[timed, "forward_s"] > 0).all() and (steps.loc[timed, "backward_s"] > 0).all()
    assert (steps.loc[timed, "comm_ratio"] >= 0).all() and (steps.loc[timed, "data_s"] == 0).all()
    for column in ("forward_s", "backward_s", "data_s", "comm_exposed_s", "comm_ratio"):
        assert steps.loc[~timed, column].isna().all(), column  # unknown, not "took no time"
    assert (steps["step_s"] > 0).all() and steps["loss"].notna().all() and (steps["tokens"] == 8).all()
    assert seen[1] is seen[2]  # an untimed phase is one shared object: nothing made per step
    assert mon.registry.get_sample_value("meshscope_steps_total") == 2 * HOST_DETAIL_EVERY + 1
    forward = mon.registry.get_sample_value("meshscope_step_phase_seconds", {"phase": "forward"})
    assert forward == pytest.approx(steps.loc[2 * HOST_DETAIL_EVERY, "forward_s"])  # the last timed


def test_memory_is_read_on_one_step_in_memory_every_and_a_bad_value_is_nan_said_once(tmp_path, caplog):
    from meshscope.collector.probe import HostProbe

    reads = []

    class CountingProbe(HostProbe):
        def memory(self):
            reads.append(len(reads))
            return {"allocated": 0, "reserved": 0, "rss": 1000 + len(reads)}

    cfg = MonitorConfig(run_dir=tmp_path / "run", metrics_port=None, memory_every=10)
    mon = Monitor(cfg, probe=CountingProbe(), registry=CollectorRegistry())
    for step in range(25):
        with mon.step() as s:
            s.log(loss=torch.tensor(1.0), note=2.0 if step < 20 else "not a number")
    mon.close()
    assert len(reads) == 3  # steps 0, 10 and 20: the training thread reads nothing in between
    steps = load_steps(tmp_path / "run")
    assert steps["mem_rss"].tolist() == [1001] * 10 + [1002] * 10 + [1003] * 5  # the latest reading
    assert steps["loss"].eq(1.0).all()  # one bad key spoils no other
    said = [r.getMessage() for r in caplog.records if "'note' is not a number" in r.getMessage()]
    assert len(said) == 1, said


def test_expert_counts_are_summed_every_k_steps(tmp_path):
    mon = make_monitor(tmp_path, expert_every=2)
    model = mon.watch(torch.nn.Sequential(ToyMoE([3, 1]), ToyMoE([2, 2])))
    for _ in range(4):
        with mon.step(tokens=4):
            model(torch.randn(1, 4))
    mon.close()
    df = load_expert_load(tmp_path / "run")
    assert sorted(df["step"].unique()) == [1, 3]
    at1 = df[df["step"] == 1].sort_values(["layer", "expert"])["tokens"].tolist()
    assert at1 == [6, 2, 4, 4]  # two steps of counts, per layer and expert
    get = mon.registry.get_sample_value
    assert get("meshscope_expert_tokens_total", {"layer": "0", "expert": "0"}) == 12
    assert get("meshscope_expert_imbalance_ratio", {"layer": "0"}) == 1.5


class InPlaceMoE(ToyMoE):
    """A layer that keeps one counts tensor and rewrites it in place each forward."""

    def forward(self, x):
        self.expert_token_counts.copy_(torch.tensor(self.counts, dtype=torch.float32))
        return self.lin(x)


class SkippingModel(torch.nn.Module):
    """Runs its second MoE layer only when asked: a layer that did not run adds nothing."""

    def __init__(self):
        super().__init__()
        self.a, self.b = InPlaceMoE([3, 1]), ToyMoE([2, 2])

    def forward(self, x, skip=False):
        x = self.a(x)
        return x if skip else self.b(x)


def test_expert_counts_take_one_watch_and_count_only_the_layers_that_ran(tmp_path):
    mon = make_monitor(tmp_path, expert_every=2)
    model = mon.watch(SkippingModel())
    # no forward hook anywhere (one sends every call through nn.Module's slow path): one
    # wrapper around the model's forward, which keeps its keyword arguments
    assert not any(m._forward_hooks for m in model.modules()) and "forward" in vars(model)
    for step in range(4):
        with mon.step(tokens=4):
            model(torch.randn(1, 4), skip=step % 2 == 1)  # b runs at steps 0 and 2 only
    mon.close()
    df = load_expert_load(tmp_path / "run")
    at1 = df[df["step"] == 1].sort_values(["layer", "expert"])["tokens"].tolist()
    assert at1 == [6, 2, 2, 2]  # a: rewritten in place, counted twice; b: ran once


class CountingModel(torch.nn.Module):
    """Counts that change every forward: an in-place layer, a layer with new tensors, and a
    layer that runs every other forward. What a window sums is each forward's own counts."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = InPlaceMoE([0, 0]), ToyMoE([0, 0]), ToyMoE([0, 0])
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        n = self.calls
        self.a.counts, self.b.counts, self.c.counts = [n, 1], [1, n], [n * n, 0]
        x = self.b(self.a(x))
        return self.c(x) if n % 2 else x


def test_a_window_sums_each_forwards_own_counts_whatever_the_layer_does(tmp_path, caplog):
    mon = make_monitor(tmp_path, expert_every=3)
    model = mon.watch(CountingModel())
    for _ in range(6):
        with mon.step(tokens=4):
            model(torch.randn(1, 4))
    mon.close()
    df = load_expert_load(tmp_path / "run").sort_values(["step", "layer", "expert"])
    by_step = {s: g["tokens"].tolist() for s, g in df.groupby("step")}
    # forwards 1-3, then 4-6; c runs on odd forwards only (1 + 9, then 25)
    assert by_step == {2: [6, 3, 3, 6, 10, 0], 5: [15, 3, 3, 15, 25, 0]}
    assert "in place" not in caplog.text


class ReusingMoE(ToyMoE):
    """Hands out a new counts tensor, then zeroes it in place at its next forward: a layer
    the Monitor can no longer read right, and says so."""

    def forward(self, x):
        if self.expert_token_counts is not None:
            self.expert_token_counts.zero_()
        return super().forward(x)


def test_a_layer_that_changes_counts_it_handed_out_is_named_once(tmp_path, caplog):
    mon = make_monitor(tmp_path, expert_every=2)
    model = mon.watch(torch.nn.Sequential(ReusingMoE([3, 1])))
    for _ in range(4):
        with mon.step(tokens=4):
            model(torch.randn(1, 4))
    mon.close()
    assert caplog.text.count("MoE layer 0 changed expert_token_counts in place") == 1


def test_an_inference_mode_forward_is_counted_and_training_goes_on(tmp_path):
    mon = make_monitor(tmp_path, expert_every=2)
    model = mon.watch(torch.nn.Sequential(ToyMoE([3, 1])))
    with mon.step(tokens=4):
        with torch.inference_mode():  # an evaluation first: its counts start the window
            model(torch.randn(1, 4))
    with mon.step(tokens=4):
        model(torch.randn(1, 4)).sum().backward()
    mon.close()
    df = load_expert_load(tmp_path / "run")
    assert df[df["step"] == 1].sort_values("expert")["tokens"].tolist() == [6, 2]


class HeldExperts(ToyMoE):
    """Expert parallelism's per-rank fact too: the tokens this rank's experts processed."""

    def forward(self, x):
        self.expert_work = torch.tensor([2.0, 5.0])
        return super().forward(x)


def test_expert_work_after_an_inference_mode_forward_is_counted_and_training_goes_on(tmp_path):
    mon = make_monitor(tmp_path, expert_every=2)
    model = mon.watch(torch.nn.Sequential(HeldExperts([3, 1])))
    with mon.step(tokens=4):
        with torch.inference_mode():
            model(torch.randn(1, 4))
    with mon.step(tokens=4):
        model(torch.randn(1, 4)).sum().backward()
    mon.close()
    work = load_expert_work(tmp_path / "run")
    assert work[["step", "layer", "tokens"]].values.tolist() == [[1, 0, 14]]


def test_non_finite_loss_is_one_event_and_a_fault(tmp_path):
    mon = make_monitor(tmp_path)
    for loss in [1.0, math.nan, math.inf, 1.0, math.nan]:
        with mon.step() as s:
            s.log(loss=torch.tensor(loss))
    mon.close()
    events = load_events(tmp_path / "run", kind="nan")
    assert events["step"].tolist() == [1, 4]
    assert mon.registry.get_sample_value("meshscope_faults_total", {"kind": "nonfinite"}) == 2


def test_exporter_serves_metrics_and_writes_targets(tmp_path):
    port = free_port_range(2)
    env = DistEnv(rank=2, world_size=4, local_rank=0, local_world_size=2, node="n1")
    mon = Monitor(
        MonitorConfig(run_dir=tmp_path / "run", run_id="abc", metrics_port=port),
        env=env,
        registry=CollectorRegistry(),
    )
    with mon.step(tokens=8):
        pass
    mon.flush()  # records go out once per window of sync_every steps, or on flush
    body = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    assert "meshscope_steps_total 1.0" in body
    targets = json.loads((tmp_path / "run" / "targets.json").read_text())
    assert [t["targets"] for t in targets] == [[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]
    assert [t["labels"]["rank"] for t in targets] == ["2", "3"]
    assert targets[0]["labels"] == {"job": "meshscope", "run": "abc", "rank": "2", "node": "n1"}
    mon.close()


def test_busy_port_is_a_clear_error(tmp_path):
    port = free_port_range(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        with pytest.raises(PortInUseError, match=f"metrics port {port}.*--metrics-port"):
            make_monitor(tmp_path, metrics_port=port)


def test_bad_monitor_config_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="expert_every"):
        MonitorConfig(run_dir=tmp_path, expert_every=0)
    with pytest.raises(ValueError, match="memory_every"):
        MonitorConfig(run_dir=tmp_path, memory_every=0)
    with pytest.raises(ValueError, match="drain_interval_s"):
        MonitorConfig(run_dir=tmp_path, drain_interval_s=0)


@pytest.mark.parametrize(
    "log_loss,expect_nan", [(None, False), (float("nan"), True), (float("inf"), True), (1.0, False)]
)
def test_a_loss_never_logged_is_absent_not_nan(tmp_path, log_loss, expect_nan):
    """A Monitor user who never calls s.log(loss=...) gets no `nan` anomaly; a logged NaN or
    Inf does (the store keeps NaN as NULL either way: the `nonfinite` column tells them apart)."""
    from meshscope.collector.schema import nonfinite_mask
    from meshscope.collector.store import load_steps
    from meshscope.detectors.engine import DetectionEngine

    mon = make_monitor(tmp_path)
    for step in range(40):
        with mon.step(tokens=8) as s:
            if log_loss is not None:
                s.log(loss=log_loss if step >= 30 else 1.0)
    mon.close()
    steps = load_steps(tmp_path / "run")
    late = steps["step"] >= 30
    assert steps.loc[~late, "loss"].isna().all() == (log_loss is None)
    flagged = nonfinite_mask(steps)
    assert list(flagged) == list(late & expect_nan)  # the flags fall where the bad losses were
    found = []
    engine = DetectionEngine(on_close=found.append)
    engine.process(steps, None)
    engine.finish()
    assert any(e.type == "nan" for e in found) == expect_nan, [e.type for e in found]


@pytest.mark.parametrize("device, threads", [("cpu", torch.get_num_threads()), ("meta", 1)])
def test_the_node_says_what_its_ranks_share_counting_host_threads_only_for_host_compute(
    tmp_path, device, threads
):
    """A model on the host keeps torch's intra-op threads busy; one on an accelerator (meta
    stands in) keeps one host thread per rank busy."""
    from meshscope.collector.store import load_events

    mon = make_monitor(tmp_path)
    mon.watch(torch.nn.Linear(4, 4, device=device))
    mon.close()
    (host,) = load_events(tmp_path / "run", kind="host")["detail"]
    assert host["ranks"] == 1 and host["threads"] == threads and host["cores"] >= 1, host
