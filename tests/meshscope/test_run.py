"""`meshscope run` end to end on 2 gloo ranks, and its answers to bad input."""

import json
import socket
import sys
import time

import pytest
from typer.testing import CliRunner

from fixtures.ports import free_port_range
from fixtures.runs import sample, scrape, start_run, wait_for
from meshscope.cli import app
from meshscope.collector.store import load_events, load_expert_load, load_steps

FAMILIES = [
    "meshscope_step_duration_seconds",
    "meshscope_step_phase_seconds",
    "meshscope_steps",
    "meshscope_tokens",
    "meshscope_comm_ratio",
    "meshscope_comm_seconds",
    "meshscope_comm_bytes",
    "meshscope_loss",
    "meshscope_grad_norm",
    "meshscope_memory_bytes",
    "meshscope_expert_tokens",
    "meshscope_expert_load_ratio",
    "meshscope_expert_imbalance_ratio",
    "meshscope_heartbeat_age_seconds",
    "meshscope_faults",
    "meshscope_restarts",
    "meshscope_recovery_seconds",
    "meshscope_run_info",
]
DETECTOR_FAMILIES = ["meshscope_anomaly_score", "meshscope_anomalies"]


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    port = free_port_range(3)  # two ranks, then the detector
    proc = start_run(root, "it", port, "--linger", "5", "--compression", "fp16")

    def finished_on_both():
        scraped = [scrape(port + r) for r in range(2)]
        if all(s and sample(s, "meshscope_steps", "_total") == 20 for s in scraped):
            return scraped
        return None

    scraped = wait_for(finished_on_both, timeout=120)
    detector = scrape(port + 2)
    targets = json.loads((root / "it" / "targets.json").read_text())
    out, _ = proc.communicate(timeout=120)
    return {
        "dir": root / "it",
        "scraped": scraped,
        "detector": detector,
        "targets": targets,
        "rc": proc.returncode,
        "out": out,
        "root": root,
    }


def test_run_succeeds_with_a_summary(live_run):
    assert live_run["rc"] == 0, live_run["out"]
    assert "compression ratio" in live_run["out"] and "store.sqlite" in live_run["out"]
    assert "2 ranks on cpu (gloo)" in live_run["out"]  # what was chosen, never "auto"


def test_every_rank_exports_every_family(live_run):
    assert live_run["scraped"], "the ranks' /metrics never reported 20 steps"
    for rank, families in enumerate(live_run["scraped"]):
        missing = [f for f in FAMILIES if f not in families]
        assert not missing, f"rank {rank} lacks {missing}"
        assert sample(families, "meshscope_step_duration_seconds", "_count") == 20
        assert sample(families, "meshscope_comm_bytes", "_total", kind="wire") > 0
        assert sample(families, "meshscope_run_info", compression="fp16") == 1
    rank0, rank1 = live_run["scraped"]
    # expert load is summed over ranks and exported by rank 0 only
    assert sample(rank0, "meshscope_expert_load_ratio", layer="1", expert="3") is not None
    assert not rank1["meshscope_expert_load_ratio"].samples


def test_every_rank_keeps_to_the_series_budget(live_run):
    from meshscope.collector.metrics import SERIES_PER_RANK, node_leader_extra_series, rank0_extra_series

    counts = [sum(len(f.samples) for f in families.values()) for families in live_run["scraped"]]
    assert 0 < counts[1] <= SERIES_PER_RANK, counts  # any rank but 0: independent of the world
    layers = len(live_run["scraped"][0]["meshscope_layer_grad_norm"].samples)
    # rank 0 also leads its node: the node watcher's heartbeat ages (once it has looked)
    budget = SERIES_PER_RANK + rank0_extra_series(2, 4, layers) + node_leader_extra_series(2)
    assert counts[0] <= budget, counts  # tiny.toml: 2 layers x 4 experts, 2 ranks on this node


def test_the_detector_exports_its_own_families_only(live_run):
    detector = live_run["detector"]
    assert detector and all(f in detector for f in DETECTOR_FAMILIES)
    assert sample(detector, "meshscope_anomalies", "_total", type="straggler") == 0  # from zero
    assert "meshscope_comm_ratio" not in detector  # per-rank queries never see the detector


def test_targets_name_ranks_and_detector_and_leave_prometheus_when_the_run_ends(live_run):
    jobs = [(t["labels"]["job"], t["labels"].get("rank")) for t in live_run["targets"]]
    assert jobs == [("meshscope", "0"), ("meshscope", "1"), ("meshscope_detector", None)]
    assert not (live_run["root"] / "_targets" / "it.json").exists()  # a clean end


def test_store_has_one_row_per_rank_per_step_and_loss_falls(live_run):
    steps = load_steps(live_run["dir"])
    assert len(steps) == 40
    assert steps.groupby("rank")["step"].apply(list).tolist() == [list(range(20))] * 2
    loss = steps[steps["rank"] == 0]["loss"].tolist()
    assert sum(loss[-5:]) / 5 < loss[0] - 0.3
    assert (steps["bytes_wire"] < steps["bytes_raw"]).all() and (steps["comm_exposed_s"] >= 0).all()
    in_flight = steps.set_index(["rank", "step"])["comm_total_s"]
    assert sorted(in_flight.dropna().index.get_level_values("step")) == [0, 0, 10, 10]  # sampled
    assert (in_flight.dropna() > 0).all()
    experts = load_expert_load(live_run["dir"])
    assert sorted(experts["step"].unique()) == [4, 9, 14, 19]
    per_window = experts.groupby(["step", "layer"])["tokens"].sum().unique()
    assert per_window.tolist() == [5 * 2 * 8 * 16 * 2]  # steps x ranks x batch x seq x top_k
    assert {"run_start", "run_end"} <= set(load_events(live_run["dir"])["kind"])
    assert (live_run["dir"] / "targets.json").exists()


runner = CliRunner()


def test_bad_config_value_exits_2_naming_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nsteps = -1\n")
    result = runner.invoke(app, ["run", "--config", str(bad), "--run-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "train.steps" in result.output
    result = runner.invoke(app, ["run", "--compression", "zip", "--run-dir", str(tmp_path)])
    assert result.exit_code == 2 and "train.compression" in result.output


def test_busy_metrics_port_is_a_clear_message(tmp_path):
    port = free_port_range(2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port + 1))
        s.listen()
        result = runner.invoke(
            app, ["run", "--nproc", "2", "--metrics-port", str(port), "--run-dir", str(tmp_path)]
        )
    assert result.exit_code == 2
    assert f"metrics port {port + 1}" in result.output and "already in use" in result.output


def test_npu_without_torch_npu_is_a_clear_message(tmp_path):
    result = runner.invoke(app, ["run", "--device", "npu", "--run-dir", str(tmp_path)])
    assert result.exit_code == 2 and "torch_npu" in result.output


def test_a_backend_that_cannot_carry_the_device_is_a_clear_message(tmp_path):
    result = runner.invoke(app, ["run", "--device", "cpu", "--backend", "nccl", "--run-dir", str(tmp_path)])
    assert result.exit_code == 2 and "--backend nccl: cannot carry cpu tensors" in result.output


def test_more_ranks_than_gpus_on_nccl_exits_2_and_points_at_gloo(tmp_path, monkeypatch):
    from meshscope.trainer import device as devmod

    monkeypatch.setattr(devmod, "cuda_count", lambda: 1)
    result = runner.invoke(app, ["run", "--device", "cuda", "--nproc", "2", "--run-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "--nproc 2 on nccl needs 2 visible cuda devices, 1 is visible" in result.output
    assert "--backend gloo" in result.output


def test_the_summary_explains_a_missing_compression_ratio():
    from meshscope.cli.run import _compression_cell

    assert _compression_cell({"ranks": 1.0, "compression_ratio": float("nan")}).startswith("n/a (one rank")
    assert _compression_cell({"ranks": 2.0, "compression_ratio": 2.0}) == "2.0x"


def test_the_version_is_said_once():
    import importlib.metadata

    import meshscope
    from meshscope.collector.version import VERSION

    assert importlib.metadata.version("meshscope") == meshscope.__version__ == VERSION


def test_a_zygote_that_will_not_serve_means_one_warning(tmp_path, monkeypatch, capsys):
    from meshscope import launcher
    from meshscope.config import load_config

    fake = tmp_path / "python"  # stands in for the interpreter that would run trainer.zygote
    fake.write_text(
        "#!/bin/sh\necho 'meshscope zygote: not serving, forking is unsafe: "
        "torch.cuda.init was called' >&2\necho '  File x.py, line 1' >&2\nexit 3\n"
    )
    fake.chmod(0o755)
    cfg = load_config(None, {"runs_root": str(tmp_path), "run_id": "z"})
    (cfg.run_dir / "logs").mkdir(parents=True)
    monkeypatch.setattr(launcher.sys, "executable", str(fake))
    sleeper = [sys.executable, "-c", "import time; time.sleep(1)"]  # stands in for torchrun
    monkeypatch.setattr(launcher, "torchrun_command", lambda *_a, **_k: sleeper)
    run = launcher.launch(cfg)
    assert run.zygote is not None
    while run.poll() is None:
        time.sleep(0.05)
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "torch.cuda.init was called" in err
    # its clients start plain workers themselves: tests/trainer/test_zygote.py


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--smtp", "nohost", "--email-to", "a@b"], "--smtp 'nohost': expected HOST:PORT"),
        (["--smtp", "h:99999", "--email-to", "a@b"], "--smtp 'h:99999': expected HOST:PORT"),
        (["--nnodes", "2:1"], "elastic.nnodes: '2:1' needs 1 <= MIN <= MAX"),
        (
            ["--slack-webhook-file", "/nonexistent/hook"],
            "--slack-webhook-file /nonexistent/hook: cannot read it",
        ),
    ],
)
def test_bad_alert_and_topology_flags_exit_2_and_write_nothing(tmp_path, flags, message):
    result = runner.invoke(app, ["run", *flags, "--steps", "1", "--run-dir", str(tmp_path / "r")])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_alert_settings_live_in_the_toml_and_flags_override_them(tmp_path):
    from meshscope.config import load_config as load

    toml = tmp_path / "alerts.toml"
    toml.write_text('[alerts]\nemail_to = "a@b"\nsmtp = "nohost"\nsmtp_tls = false\n')
    assert (load(toml).alerts.email_to, load(toml).alerts.smtp_tls) == (["a@b"], False)
    result = runner.invoke(app, ["run", "-c", str(toml), "--steps", "1", "--run-dir", str(tmp_path / "r")])
    assert result.exit_code == 2 and "--smtp 'nohost': expected HOST:PORT" in result.output
    bad = tmp_path / "bad.toml"
    bad.write_text('[alerts]\nmode = "sometimes"\n')
    result = runner.invoke(app, ["run", "-c", str(bad), "--run-dir", str(tmp_path / "r")])
    assert result.exit_code == 2 and "alerts.mode" in result.output
    assert not (tmp_path / "r").exists()


def test_inputs_that_are_not_what_they_claim_exit_2(tmp_path):
    import sqlite3

    noise = tmp_path / "noise"
    noise.mkdir()
    (noise / "store.sqlite").write_bytes(bytes(range(256)) * 8)  # not a database at all
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    with sqlite3.connect(foreign / "store.sqlite") as conn:  # a database, not a run store
        conn.execute("CREATE TABLE foo (x)")
    for run in (noise, foreign):
        result = runner.invoke(app, ["detect", "--run", str(run)])
        assert result.exit_code == 2 and "meshscope run store" in result.output
        assert "Traceback" not in result.output
    csv = tmp_path / "latin.csv"
    csv.write_bytes(b"time,value\n1,caf\xe9\n")
    result = runner.invoke(app, ["detect", str(csv)])
    assert result.exit_code == 2 and "not UTF-8 text" in result.output
    toml = tmp_path / "latin.toml"
    toml.write_bytes(b"# caf\xe9\n[train]\nsteps = 3\n")
    result = runner.invoke(app, ["run", "--config", str(toml), "--run-dir", str(tmp_path / "r")])
    assert result.exit_code == 2 and "not UTF-8 text" in result.output


def test_sigterm_stops_torchrun_and_every_worker_and_records_the_end(tmp_path):
    import os
    import signal
    import time

    from fixtures.runs import start_run
    from meshscope.collector.store import latest_step, load_events
    from meshscope.watchdog.watch import pid_alive

    proc = start_run(tmp_path, "s", None, "--steps", "100000")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and latest_step(tmp_path / "s", rank=0) < 3:
        time.sleep(0.5)
    assert latest_step(tmp_path / "s", rank=0) >= 3, "the run never got going"
    pids = [int(p.read_text()) for p in (tmp_path / "s" / "pids").glob("rank*.pid")]
    assert len(pids) == 2
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 128 + signal.SIGTERM, out[-2000:]
    assert "stopped by SIGTERM" in out
    time.sleep(1.0)
    assert not any(pid_alive(p) for p in pids), "workers left training after meshscope run ended"
    ends = load_events(tmp_path / "s", kind="run_end")
    assert len(ends) == 1 and ends.iloc[0]["detail"]["reason"] == "sigterm", ends
    assert os.path.exists(tmp_path / "s" / "store.sqlite")
