"""`meshscope advise` as a user runs it: the example files, bad input (exit 2 naming the field,
nothing searched), and calibration on a real run of the trainer; the run's summary carries its
Training Efficiency Index against a one-device run beside it."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from fixtures.runs import REPO, meshscope, start_run
from meshscope.cli import app

EXAMPLES = REPO / "advisor/examples"
MODEL = EXAMPLES / "moe-128e.toml"
CPU = EXAMPLES / "cpu-local.toml"
REFERENCE = EXAMPLES / "reference-moe.toml"


def advise(*args: str):
    """`meshscope advise` in-process (the subprocess start costs seconds; one test keeps it)."""
    result = CliRunner().invoke(app, ["advise", *args], catch_exceptions=True)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


@pytest.mark.parametrize("cluster", ["ascend-910b", "h100"])
def test_the_example_files_give_a_ranked_answer(cluster):
    if cluster == "ascend-910b":  # as a user runs it, once
        done = meshscope("advise", "--model", "moe-128e", "--cluster", cluster, "--json")  # bundled, by name
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
    else:
        done = advise("--model", "moe-128e", "--cluster", cluster, "--json")
        assert done.exit_code == 0, done.output
        out = json.loads(done.stdout)
    assert out["evaluated"] > 10_000 and len(out["layouts"]) == 10
    best = out["layouts"][0]
    assert best["tp"] * best["pp"] * best["cp"] * best["dp"] == 1024
    assert best["step_lo_s"] < best["step_s"] < best["step_hi_s"] and best["memory_gib"] > 0
    assert [row["step_s"] for row in out["layouts"]] == sorted(row["step_s"] for row in out["layouts"])
    assert all(v["from"] == "default" for v in out["factors"].values())
    assert any("balanced" in note for note in out["notes"])  # the skew was not measured: it says so


def test_the_table_names_the_binding_constraint_and_the_factors_sources():
    done = advise("--model", str(REFERENCE), "--cluster", str(CPU), "--set", "top=3")
    assert done.exit_code == 0, done.output
    assert "binding constraint:" in done.stdout and "efficiency factors" in done.stdout
    assert "default" in done.stdout


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--model", str(CPU), "--cluster", str(CPU)], "layers"),  # a cluster file given as the model
        (["--model", str(MODEL), "--cluster", str(MODEL)], "nodes"),
        (["--model", str(MODEL), "--cluster", str(CPU), "--set", "max_comm_ratio=2"], "max_comm_ratio"),
        (["--model", str(MODEL), "--cluster", str(CPU), "--set", "goal=speed"], "goal"),
        (["--model", str(MODEL), "--cluster", str(CPU), "--set", "nonsense=1"], "nonsense"),
        (["--model", "/nonexistent.toml", "--cluster", str(CPU)], "/nonexistent.toml"),
        (["--model", str(MODEL), "--cluster", str(CPU), "--calibrate", "/nonexistent"], "--calibrate"),
    ],
)
def test_bad_input_exits_2_naming_the_field(args, named, tmp_path):
    done = advise(*args)
    assert done.exit_code == 2, done.output
    assert "error:" in done.stderr and named in done.stderr, done.stderr


def test_a_model_whose_shapes_disagree_is_refused(tmp_path):
    bad = tmp_path / "m.toml"
    bad.write_text(MODEL.read_text().replace("heads = 32", "heads = 30"))
    done = advise("--model", str(bad), "--cluster", str(CPU))
    assert done.exit_code == 2 and "heads" in done.stderr


@pytest.fixture(scope="module")
def measured_runs(tmp_path_factory):
    """A 2-rank expert-parallel run and a one-device run of the same model beside it."""
    root = tmp_path_factory.mktemp("runs")
    for run_id, extra in (("one", ["--nproc", "1"]), ("ep2", ["--set", "parallel.ep=2"])):
        proc = start_run(root, run_id, None, "--steps", "25", *extra)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
    return root, out


def test_calibration_on_a_real_run_says_which_factors_it_measured(measured_runs):
    root, _ = measured_runs
    done = advise(
        "--model", str(REFERENCE), "--cluster", str(CPU), "--calibrate", str(root / "ep2"), "--json"
    )
    assert done.exit_code == 0, done.output
    factors = json.loads(done.stdout)["factors"]
    for name in ("compute_efficiency", "allreduce_efficiency", "alltoall_efficiency", "dp_overlap"):
        assert factors[name]["from"] == "measured (ep2)", name
    assert factors["p2p_efficiency"]["from"] == "default"
    assert not any("balanced" in n for n in json.loads(done.stdout)["notes"])  # the run's skew is used


def test_a_run_on_another_backend_is_left_out_with_a_warning(measured_runs):
    root, _ = measured_runs
    hccl = EXAMPLES / "ascend-910b.toml"
    done = advise("--model", str(MODEL), "--cluster", str(hccl), "--calibrate", str(root / "ep2"), "--json")
    assert done.exit_code == 0
    assert "left out: ran on gloo, the cluster file says hccl" in done.stderr
    assert all(v["from"] == "default" for v in json.loads(done.stdout)["factors"].values())


def test_the_summary_gives_the_training_efficiency_index_against_the_one_device_run(measured_runs):
    _, last_output = measured_runs
    line = next(x for x in last_output.splitlines() if "training efficiency index" in x)
    assert "one device: one" in line and "scaling" in line, line
    # one communication overhead: the summary's row and the TEI's factor are the same figure
    shown = float(re.search(r"comm overhead \(exposed\)\W+([\d.]+)%", last_output).group(1)) / 100
    in_tei = float(re.search(r"1 - comm ([\d.]+)", line).group(1))
    assert abs(shown - in_tei) <= 0.006, (shown, in_tei)


def test_calibrate_reads_a_store_that_is_not_a_trainer_run(tmp_path):
    (tmp_path / "empty").mkdir()
    done = advise("--model", str(REFERENCE), "--cluster", str(CPU), "--calibrate", str(tmp_path / "empty"))
    assert done.exit_code == 0
    assert "left out" in done.stderr


def test_every_bundled_example_loads_by_name():
    from meshscope.advisor.specs import examples, load_cluster, load_model

    clusters, models = examples("cluster"), examples("model")
    assert {"ascend-910b", "h100", "cpu-local"} <= set(clusters) and {"moe-128e", "reference-moe"} <= set(
        models
    )
    assert len(clusters) + len(models) == len(list(EXAMPLES.glob("*.toml")))
    for name in clusters:
        assert load_cluster(name).devices > 0
    for name in models:
        assert load_model(name).layers > 0


def test_the_views_advisor_page_shows_what_the_run_changed(measured_runs, monkeypatch):
    from streamlit.testing.v1 import AppTest

    root, _ = measured_runs
    monkeypatch.setenv("MESHSCOPE_VIEW_RUNS_DIR", str(root))
    at = AppTest.from_file(str(REPO / "view" / "app.py"), default_timeout=60)
    at.query_params["run"] = "ep2"
    at.run()
    at.switch_page("screens/advisor.py").run()
    assert not at.exception, [e.value for e in at.exception]
    shown = "\n".join(m.value for m in at.markdown)
    assert "Binding constraint" in shown and "This run's own layout (dp2 ep2 mb8)" in shown, shown
    factors = at.dataframe[1].value.set_index("factor")
    assert factors.loc["compute_efficiency", "from"] == "measured (ep2)"
    assert factors.loc["p2p_efficiency", "from"] == "default"
    ranked = at.dataframe[0].value
    assert len(ranked) > 0 and ranked["step_s"].is_monotonic_increasing
    run_page = AppTest.from_file(str(REPO / "view" / "app.py"), default_timeout=60)
    run_page.query_params["run"] = "ep2"
    run_page.run()
    assert any(
        "Training efficiency index" in m.value and "one device: one" in m.value for m in run_page.markdown
    )


def test_settings_come_from_the_cluster_files_advisor_table_then_set(tmp_path):
    cluster = tmp_path / "c.toml"
    cluster.write_text(CPU.read_text() + "\n[advisor]\ntop = 2\nmax_comm_ratio = 0.9\n")
    out = json.loads(advise("--model", str(REFERENCE), "--cluster", str(cluster), "--json").stdout)
    assert len(out["layouts"]) == 2
    out = json.loads(
        advise("--model", str(REFERENCE), "--cluster", str(cluster), "--json", "--set", "top=3").stdout
    )
    assert len(out["layouts"]) == 3  # --set wins over the file
    cluster.write_text(CPU.read_text() + "\n[advisor]\nmax_comm_ratio = 7\n")
    bad = advise("--model", str(REFERENCE), "--cluster", str(cluster))
    assert bad.exit_code == 2 and "advisor table" in bad.stderr and "max_comm_ratio" in bad.stderr


def test_meshscope_config_lists_the_advisor_settings():
    result = CliRunner().invoke(app, ["config", "--advisor", "--json"])
    fields = {json.loads(line)["field"] for line in result.stdout.splitlines()}
    assert {"goal", "max_comm_ratio", "memory_headroom", "max_tp", "micro_batches", "top"} <= fields
