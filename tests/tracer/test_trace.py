"""The tracer names the first non-finite module; snapshots load without pickle and replay."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshscope.tracer.replay import replay
from meshscope.tracer.snapshot import SnapshotError, load_snapshot
from meshscope.tracer.trace import TensorTracer, TracerConfig
from meshscope.trainer.config import ModelConfig
from meshscope.trainer.inject import InjectionError, Injector, parse_injection
from meshscope.trainer.loop import step_if_finite
from meshscope.trainer.model import MoELM

CFG = ModelConfig(vocab_size=32, seq_len=8, layers=2, d_model=16, heads=2, experts=4, top_k=2)


def traced_steps(tmp_path, spec: str, steps: int = 4, mode: str = "nonfinite"):
    """Train a small model a few steps with one injection; returns the tracer's reports."""
    torch.manual_seed(0)
    model = MoELM(CFG)
    injector = Injector([parse_injection(spec)], 0, lambda inj, step: None)
    injector.arm(model)
    reports = []
    tracer = TensorTracer(
        model,
        TracerConfig(mode=mode),
        snapshot_dir=tmp_path / "snapshots",
        report=lambda kind, step, detail: reports.append((kind, step, detail)),
        stats_sink=lambda rows: reports.append(("stats", rows[0]["step"], rows)),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len))
    for step in range(steps):
        injector.before_step(step, model)
        tracer.step_begin(step)

        def rerun(step=step):
            return injector.poison_loss(model.loss(model(tokens), tokens)[0], step)

        loss = rerun()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        step_if_finite(opt, norm)  # as the trainer does: the weights move, a NaN step is skipped
        opt.zero_grad()
        tracer.step_end(loss=loss, grad_norm=norm, rerun=rerun)
    tracer.close()
    return reports


@pytest.mark.parametrize("module", ["blocks.1.moe.router.gate", "blocks.0.ln2", "blocks.0.attn"])
def test_names_the_module_poisoned_in_forward(tmp_path, module):
    reports = traced_steps(tmp_path, f"nan@step=2,rank=0,module={module}")
    nans = [(step, d) for kind, step, d in reports if kind == "nan"]
    assert len(nans) == 1, nans  # the step after, the weight is back: nothing more to report
    step, detail = nans[0]
    assert step == 2 and detail["module"] == module and detail["where"] == "forward"
    assert detail["tensor"] == "parameter"


@pytest.mark.parametrize("module", ["blocks.1.moe.router.gate", "blocks.0.ln1", "blocks.0.moe.experts"])
def test_names_the_module_poisoned_in_backward(tmp_path, module):
    reports = traced_steps(tmp_path, f"nan@step=1,rank=0,module={module},where=backward")
    nans = [(step, d) for kind, step, d in reports if kind == "nan"]
    assert [(s, d["module"], d["where"], d["tensor"]) for s, d in nans] == [
        (1, module, "backward", "gradient")
    ]


def test_a_nan_loss_is_traced_to_the_gradient_entering_the_model(tmp_path):
    reports = traced_steps(tmp_path, "nan@step=1,rank=0")
    nans = [d for kind, _s, d in reports if kind == "nan"]
    assert len(nans) == 1 and nans[0]["where"] == "backward"
    assert "loss" in nans[0]["note"]


def test_a_clean_run_finds_nothing(tmp_path):
    reports = traced_steps(tmp_path, "nan@step=99,rank=0")
    assert not [r for r in reports if r[0] == "nan"]


def test_replay_reproduces_a_forward_finding(tmp_path):
    reports = traced_steps(tmp_path, "nan@step=2,rank=0,module=blocks.1.moe.router.gate")
    path = next(d["snapshot"] for kind, _s, d in reports if kind == "nan")
    snap = load_snapshot(path)
    assert snap.meta.module == "blocks.1.moe.router.gate" and snap.meta.step == 2
    module = MoELM(CFG).get_submodule(snap.meta.module)
    result = replay(snap, module)
    assert result.reproduced and result.nonfinite, result.message


def test_replay_of_an_injected_gradient_says_it_is_not_the_module(tmp_path):
    reports = traced_steps(tmp_path, "nan@step=1,rank=0,module=blocks.0.ln1,where=backward")
    path = next(d["snapshot"] for kind, _s, d in reports if kind == "nan")
    result = replay(load_snapshot(path), MoELM(CFG).get_submodule("blocks.0.ln1"))
    assert not result.reproduced and "hook" in result.message


@pytest.mark.parametrize("mode", ["nonfinite", "stats", "full"])
def test_every_mode_names_the_module(tmp_path, mode):
    for spec, where in [
        ("nan@step=2,rank=0,module=blocks.0.ln2", "forward"),
        ("nan@step=2,rank=0,module=blocks.1.ln1,where=backward", "backward"),
    ]:
        reports = traced_steps(tmp_path / where, spec, mode=mode)
        nans = [(s, d["module"], d["where"]) for kind, s, d in reports if kind == "nan"]
        assert nans == [(2, spec.split("module=")[1].split(",")[0], where)], (mode, nans)


def test_stats_mode_stores_every_module(tmp_path):
    reports = traced_steps(tmp_path, "nan@step=99,rank=0", steps=2, mode="stats")
    rows = next(r for kind, _s, r in reports if kind == "stats")
    modules = {r["module"] for r in rows}
    assert {"embed", "blocks.0.moe.router.gate", "ln_f"} <= modules
    assert all(r["nonfinite"] == 0 and r["absmax"] >= 0 for r in rows)


def test_unknown_module_is_a_clear_error():
    injector = Injector([parse_injection("nan@step=1,rank=0,module=blocks.9")], 0, lambda inj, step: None)
    with pytest.raises(InjectionError, match="no module 'blocks.9'"):
        injector.arm(MoELM(CFG))


def _valid_snapshot(tmp_path):
    reports = traced_steps(tmp_path, "nan@step=1,rank=0,module=blocks.0.ln2", steps=2)
    return next(d["snapshot"] for kind, _s, d in reports if kind == "nan")


def test_malformed_and_hostile_snapshots_are_refused(tmp_path):
    meta_path = _valid_snapshot(tmp_path)
    data_path = meta_path.replace(".json", ".safetensors")
    meta = json.loads(open(meta_path).read())
    # a pickle where the tensors should be: refused, never unpickled
    import pickle

    evil = tmp_path / "evil.safetensors"
    evil.write_bytes(pickle.dumps({"x": 1}))
    (tmp_path / "evil.json").write_text(json.dumps(meta))
    with pytest.raises(SnapshotError, match="not a valid safetensors file"):
        load_snapshot(tmp_path / "evil.json")
    for broken, why in [
        ({**meta, "format": "other/9"}, "format"),
        ({**meta, "where": "sideways"}, "where"),
        ({**meta, "args": [{"tensor": "input.7"}]}, "input.7"),
        ({**meta, "exec": "rm -rf /"}, "exec"),
    ]:
        (tmp_path / "bad.json").write_text(json.dumps(broken))
        (tmp_path / "bad.safetensors").write_bytes(open(data_path, "rb").read())
        with pytest.raises(SnapshotError, match=why):
            load_snapshot(tmp_path / "bad.json")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=256))
def test_random_bytes_never_load_and_never_crash(tmp_path, blob):
    (tmp_path / "r.safetensors").write_bytes(blob)
    (tmp_path / "r.json").write_bytes(blob)
    with pytest.raises(SnapshotError):
        load_snapshot(tmp_path / "r.json")


def test_the_gradient_inspector_measures_every_layer_and_the_engine_flags_outliers():
    import pandas as pd

    from meshscope.detectors.window_rules import GradientRule
    from meshscope.tracer.gradients import GradientInspector, InspectorConfig, layer_names

    torch.manual_seed(0)
    model = MoELM(CFG)
    assert {"embed", "blocks.0", "blocks.1", "ln_f"} <= set(layer_names(model).values())
    rows, exported = [], {}
    inspector = GradientInspector(
        model,
        InspectorConfig(every=2),
        sink=rows.extend,
        export=lambda m, g, r: exported.__setitem__(m, (g, r)),
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len))
    for step in range(20):
        loss, _ = model.loss(model(tokens), tokens)
        loss.backward()
        if step == 14:  # layer blocks.1 explodes, ln_f vanishes
            for name, p in model.named_parameters():
                if name.startswith("blocks.1."):
                    p.grad.mul_(1e4)
                if name.startswith("ln_f."):
                    p.grad.mul_(1e-6)
        inspector.before_clip(step)
        opt.step()
        inspector.after_update()
        opt.zero_grad()
    inspector.close()
    assert {r["step"] for r in rows} == set(range(0, 20, 2))
    assert all(0 < r["update_ratio"] < 1 for r in rows if r["step"] != 14)
    assert set(exported) == set(layer_names(model).values())
    frame = pd.DataFrame(rows)
    rule = GradientRule(warmup=3)
    flags = rule.judge(frame.iloc[: len(frame) // 2]) + rule.judge(frame)  # in two windows
    assert sorted((f.type, f.module, s) for s, f in flags) == [
        ("gradient_exploding", "blocks.1", 14),
        ("gradient_vanishing", "ln_f", 14),
    ]


class LaggingReadback:
    """A readback whose device never catches up on its own: ready only once waited for."""

    def __init__(self, tensor):
        self._value, self._ready = tensor.detach().clone(), False

    def ready(self):
        return self._ready

    def wait(self):
        self._ready = True

    def value(self):
        return self._value


def test_a_lagging_device_never_costs_a_flag_and_the_late_rerun_meets_the_steps_fault(tmp_path, monkeypatch):
    import meshscope.tracer.trace as trace_module

    monkeypatch.setattr(trace_module, "Readback", LaggingReadback)
    module = "blocks.1.moe.router.gate"
    torch.manual_seed(0)
    model = MoELM(CFG)
    injector = Injector([parse_injection(f"nan@step=2,rank=0,module={module}")], 0, lambda inj, step: None)
    injector.arm(model)
    reports = []
    tracer = TensorTracer(
        model, TracerConfig(max_lag_steps=5), report=lambda kind, step, d: reports.append((kind, step, d))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len))
    for step in range(12):
        injector.before_step(step, model)
        tracer.step_begin(step)

        def rerun(step=step):
            injector.replay(step, model)  # as the trainer's loop does
            return model.loss(model(tokens), tokens)[0]

        loss = rerun()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        step_if_finite(opt, norm)  # as the trainer does: the weights move, a NaN step is skipped
        opt.zero_grad()
        tracer.step_end(loss=loss, grad_norm=norm, rerun=rerun)
        if step < 2 + 5:
            assert not reports, "judged before the window ran out: the device had not answered"
    nans = [(s, d) for kind, s, d in reports if kind == "nan"]
    assert len(nans) == 1, nans
    step, detail = nans[0]
    assert step == 2 and (detail["module"], detail["tensor"]) == (module, "parameter"), detail
    assert "judged 5 steps late" in detail["note"], detail
    tracer.close()


@pytest.mark.parametrize("where, tensor", [("forward", "parameter"), ("backward", "gradient")])
def test_one_expert_inside_stacked_experts_is_poisoned_and_named(tmp_path, where, tensor):
    """Experts are one stacked module: the injector poisons expert 2's slice alone, and the
    tracer names the module and the expert index."""
    reports = traced_steps(tmp_path, f"nan@step=2,rank=0,module=blocks.1.moe.experts.2,where={where}")
    found = [d for kind, _step, d in reports if kind == "nan"]
    assert found, reports
    assert found[0]["module"] == "blocks.1.moe.experts" and found[0]["tensor"] == tensor, found[0]
    assert found[0]["experts"] == [2], found[0]


def test_an_expert_index_past_the_last_is_refused_before_launch():
    from meshscope.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="holds experts 0..3, not 9"):
        load_config(
            None, {"model": {"experts": 4}, "inject": ["nan@step=1,rank=0,module=blocks.0.moe.experts.9"]}
        )


def test_under_expert_parallelism_the_expert_shard_is_a_layer_of_its_own():
    """A rank holds 1/ep of each MoE layer's experts: their norm is named for the shard, so
    the layer's replicated part keeps the number it has without expert parallelism."""
    from types import SimpleNamespace

    from meshscope.tracer.gradients import GradientInspector, expert_shards

    model = MoELM(CFG)
    moe = [m for _, m in model.named_modules() if hasattr(m, "expert_mesh")]
    assert expert_shards(model) == {}  # no expert parallelism: nothing renamed
    for m in moe:
        m.expert_mesh = SimpleNamespace(ep=2, ep_rank=1)
    shards = expert_shards(model)
    assert shards and all(".experts." in name for name in shards), shards
    layers = GradientInspector(model).layers
    assert {"blocks.0", "blocks.0.experts[ep 2/2]"} <= set(layers), layers
    assert not any(name.startswith("blocks.0.") and "[ep" not in name for name in layers), layers
